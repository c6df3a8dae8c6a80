"""Two-tier aggregation in separate processes over real RabbitMQ: a root, two edge aggregators and two hosts
serving eight clients. Kill -9 of an edge mid-round loses only its clients' round; kill -9 of the root
mid-round loses and doubles nothing."""

from __future__ import annotations

import os
import signal

import pytest
from fault_harness import Federation, delete_job_queues, read_jsonl, wait_for
from load_factor import budget

from fedmq.broker.transport import topology

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

CLIENTS, EDGES = 8, 2


@pytest.fixture
def federation(tmp_path, rabbit_url, job_id):
    fed = Federation(
        tmp_path / "fed",
        rabbit_url,
        job_id,
        clients=CLIENTS,
        rounds=3,
        hosts=2,
        edges=EDGES,
        # host h1's clients are slow every round: a round is still open at its edges when they are killed
        agent_faults={1: "slow:1.0:1.5"},
        job_options={"report_deadline_s": 15.0, "update_deadline_s": 15.0},
    )
    yield fed
    fed.stop_all()
    delete_job_queues(rabbit_url, job_id, CLIENTS, hosts=2, edges=EDGES)


def _edge_spooled(fed: Federation, edge: int, rnd: int) -> int:
    return len(list((fed.state / "edges" / f"e{edge}" / f"r{rnd:06d}").glob("update-*.msg")))


def _edge_summary(fed: Federation, name: str) -> dict:
    proc = fed.procs[name]
    proc.wait(timeout=budget(60))
    out = read_jsonl(fed.logs / f"{name}.out")
    assert proc.returncode == 0 and out, (fed.logs / f"{name}.err").read_text()[-2000:]
    return out[-1]


def test_edge_kill9_mid_round_loses_only_its_clients_round(federation):
    fed = federation.start()
    everyone = {f"h{h}-{i}" for h, (lo, hi) in enumerate(((0, 4), (4, 8))) for i in range(lo, hi)}
    e1 = {c for c in everyone if topology.edge_of(c, EDGES) == 1}
    assert e1 and e1 != everyone  # both edges have clients: the test can tell them apart
    wait_for(lambda: _edge_spooled(fed, 1, 2) >= 1, 120, "an update spooled at edge 1 in round 2")
    fed.kill9("edge-1")
    fed.start_edge(1, "edge-1b")  # a restarted edge starts afresh with the next round
    summary = fed.wait_aggregator(timeout=240)
    assert summary["rounds_completed"] == 3 and summary["rounds_skipped"] == 0
    rows = {r["round"]: r for r in fed.rows()}
    assert set(rows[1]["received"]) == everyone and set(rows[3]["received"]) == everyone
    assert set(rows[2]["received"]) == everyone - e1  # the dead edge's clients, and only they, lost round 2
    assert _edge_summary(fed, "edge-0") == {"edge": "e0", "partials": 3, "job_ended": True}
    assert _edge_summary(fed, "edge-1b")["job_ended"] is True
    audit = fed.audit()
    assert audit.duplicated == [] and audit.finite and audit.shapes_ok
    # what was lost is exactly the dead edge's clients' uploads of round 2
    lost_rounds = {rnd for rnd, _ in audit.lost}
    assert lost_rounds <= {2} and len(audit.lost) <= len(e1)


def test_root_kill9_mid_round_with_edges_loses_and_doubles_nothing(federation):
    fed = federation.start()
    # round 2: edge 1 is held (SIGSTOP) with an update taken, so the root has edge 0's partial sum spooled and
    # waits for edge 1's when it is killed
    wait_for(lambda: _edge_spooled(fed, 1, 2) >= 1, 120, "an update spooled at edge 1 in round 2")
    os.killpg(fed.procs["edge-1"].pid, signal.SIGSTOP)
    try:
        wait_for(lambda: fed.spooled_updates(2) >= 1, 120, "edge 0's partial sum spooled at the root")
        fed.kill9("agg")
        assert len(fed.rows()) == 1
        fed.start_aggregator("agg2")
    finally:
        os.killpg(fed.procs["edge-1"].pid, signal.SIGCONT)
    summary = fed.wait_aggregator("agg2", timeout=240)
    assert summary["rounds_completed"] == 3 and summary["version"] == 3
    assert fed.agg_events("resuming open round")
    audit = fed.audit()
    assert audit.lost == [] and audit.duplicated == [] and audit.unconfirmed_folded == [], audit
    assert audit.confirmed == audit.folded == 3 * CLIENTS and audit.finite
    for e in range(EDGES):
        assert _edge_summary(fed, f"edge-{e}")["job_ended"] is True
