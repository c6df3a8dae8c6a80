"""Broker failover on a three-node RabbitMQ cluster on loopback: kill -9 the node that leads the job's inbox
mid-round; the federation, given every node's address, finishes with no confirmed update lost."""

from __future__ import annotations

import json
import time

import pytest
from fault_harness import Federation, wait_for

from fedmq.broker.transport import topology as t

pytestmark = [pytest.mark.rabbitmq, pytest.mark.isolated_node, pytest.mark.slow]

ROUNDS = 6


def test_killing_the_inbox_leader_mid_round_loses_no_confirmed_update(rabbit_cluster, job_id, tmp_path):
    cluster = rabbit_cluster
    fed = Federation(
        tmp_path / "fed",
        cluster.url,
        job_id,
        clients=3,
        rounds=ROUNDS,
        job_options={"report_deadline_s": 20.0, "update_deadline_s": 20.0},
        # agents pause before reporting (1-2 s), so a round lasts long enough to be hit mid-way
        agent_faults={i: f"slow:1.0:{1.0 + 0.5 * i:.1f}" for i in range(3)},
    )
    try:
        # the inbox's leader is looked up before any agent starts: rabbitmqctl takes seconds on a busy
        # machine, and the rounds (2 s each) must not run past round 3 meanwhile
        fed.start_aggregator()
        wait_for(
            lambda: fed.agg_events(
                "waiting for the first delivery (a hot standby waits here while another aggregator is active)"
            ),
            120,
            "the aggregator declared the job",
        )
        victim = cluster.leader_of(t.q_inbox(job_id))
        # every client connected to the first address that answered: node 0,
        # where the aggregator declared the inbox
        assert victim is cluster.nodes[0], victim.name
        for i in range(fed.clients):
            fed.start_agent(i)
        wait_for(lambda: fed.round_open(1), 120, "round 1")
        wait_for(
            lambda: fed.round_open(3) and fed.spooled_updates(3) >= 1, 120, "an update spooled in round 3"
        )
        t_kill = time.monotonic()
        victim.kill9()
        assert not fed.round_closed(3), "round 3 closed before the node died: not mid-round"
        summary = fed.wait_aggregator(timeout=240)
        elapsed = time.monotonic() - t_kill
        audit = fed.audit()
        rows = fed.rows()
        new_leader = cluster.leader_of(t.q_inbox(job_id))
        print(
            "cluster failover:",
            json.dumps(
                {
                    **audit.as_dict(),
                    "after_kill_s": round(elapsed, 1),
                    "new_inbox_leader": new_leader.name,
                    "round_walls": {r["round"]: r["wall_s"] for r in rows},
                }
            ),
        )
        assert new_leader is not victim
        # the fault hit: every process lost its node and connected to another one
        for name in ("agg", *(f"agent-{i}" for i in range(3))):
            assert "reconnected to RabbitMQ" in (fed.logs / f"{name}.err").read_text(), name
        assert summary["rounds_completed"] + summary["rounds_skipped"] == ROUNDS, summary
        assert audit.rounds_skipped <= 1, audit  # at most the round the node died in, closed by its deadline
        assert audit.lost == [] and audit.duplicated == [], audit
        assert audit.confirmed > 0 and audit.finite and audit.shapes_ok, audit
        # every agent came back: each was granted its upload in the last round
        assert sorted(rows[-1]["granted"]) == [f"agent-{i}" for i in range(3)], _tails(fed)
    finally:
        fed.stop_all()


def _tails(fed: Federation, n: int = 12) -> str:
    """What each process logged last (above debug): the story of a failure, in the assertion message."""
    out = []
    for log in sorted(fed.logs.glob("*.err")):
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if '"debug"' not in ln]
        out.append(f"--- {log.name}\n" + "\n".join(ln[:300] for ln in lines[-n:]))
    return "\n".join(out)
