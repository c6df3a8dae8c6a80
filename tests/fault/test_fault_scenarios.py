"""The fault suite's fast subset: one federation on an isolated RabbitMQ node that lives through, round after round,
a broker restart (stop_app/start_app), a blocked broker (memory alarm), a cut agent connection (TCP proxy), and a
kill -9 of an agent mid-round (restarted later). Afterwards: every round finished, the audit is clean, the global
model is finite with the manifest's shapes, and no round ran past its deadlines (plus slack for evaluation).
"""

from __future__ import annotations

import time

import pytest

from fault_harness import Federation, TcpProxy, wait_for

pytestmark = [pytest.mark.isolated_node, pytest.mark.slow]


def test_federation_survives_broker_restart_memory_alarm_cut_connection_and_agent_kill(rabbit_node, job_id, tmp_path):
    node = rabbit_node
    proxy = TcpProxy(node.port)
    fed = Federation(tmp_path / "fed", node.url, job_id, clients=3, rounds=6,
                     job_options={"report_deadline_s": 8.0, "update_deadline_s": 8.0},
                     agent_faults={2: "slow:1.0:1.5"},
                     agent_url=lambda i: node.url.replace(f":{node.port}/", f":{proxy.port}/") if i == 0 else node.url)
    injected = []
    try:
        fed.start()
        # round 2: the broker application stops and starts again (every client sees CONNECTION_FORCED)
        wait_for(lambda: fed.round_open(2), 120, "round 2")
        node.stop_app()
        time.sleep(1.0)
        node.start_app()
        injected.append("broker stop_app/start_app in round 2")
        # round 3: memory alarm blocks every publisher, lifted after 3 s
        wait_for(lambda: fed.round_open(3), 120, "round 3")
        node.ctl("set_vm_memory_high_watermark", "0")
        time.sleep(3.0)
        node.ctl("set_vm_memory_high_watermark", "0.4")
        injected.append("memory alarm for 3 s in round 3")
        # round 4: agent-0's TCP connection is reset by the proxy
        wait_for(lambda: fed.round_open(4), 120, "round 4")
        proxy.cut()
        injected.append("agent-0 connection cut in round 4")
        # round 5: the slow agent is killed while it is still working, then started again
        wait_for(lambda: fed.round_open(5) and fed.spooled_updates(5) >= 1, 120, "an update in round 5")
        fed.kill9("agent-2")
        fed.start_agent(2)
        injected.append("agent-2 kill -9 in round 5, restarted")
        summary = fed.wait_aggregator("agg", timeout=180)
        audit = fed.audit()
        print("fault scenarios:", injected, audit.as_dict())
        assert summary["rounds_completed"] + summary["rounds_skipped"] == 6
        assert audit.rounds_completed == 6, audit
        assert audit.lost == [] and audit.duplicated == [], audit
        assert audit.finite and audit.shapes_ok
        assert audit.max_round_s < fed.round_limit_s(slack_s=15.0), audit
    finally:
        node.ctl("set_vm_memory_high_watermark", "0.4", check=False)
        fed.stop_all()
        proxy.close()
