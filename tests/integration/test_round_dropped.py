"""A round's ``dropped`` (its row, the `drop.` column, TensorBoard's participation/dropped) names only the
clients that did not deliver what the round expected of them: not a FedMed client that reported and was not
among the top-K granted an upload, and no one in asynchronous mode, where every version closes on the first
arrivals and the others simply come later."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import fedmq
from fedmq.aggregator.rounds import RoundStats

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def test_dropped_is_what_was_expected_and_did_not_come():
    # a grant phase: d never reported, b was granted and sent nothing, c reported and was not granted
    stats = RoundStats(1, selected=["a", "b", "c", "d"], reported={"a": 1.0, "b": 1.0, "c": 1.0})
    stats.granted, stats.received = ["a", "b"], ["a"]
    assert stats.dropped() == ["b", "d"]
    # no grant phase: every selected client is granted, and expected to upload
    stats = RoundStats(
        1, selected=["a", "b"], reported={"a": 1.0, "b": 1.0}, granted=["a", "b"], received=["a"]
    )
    assert stats.dropped() == ["b"]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def moons():
    sys.path.insert(0, str(EXAMPLES))
    try:
        from bring_your_own import TwoMoons
    finally:
        sys.path.remove(str(EXAMPLES))
    return TwoMoons


def test_top_k_clients_not_granted_and_async_non_arrivals_are_not_drops(tmp_path, moons):
    cfg = fedmq.JobConfig(
        job="drop-fedmed",
        strategy="fedmed",
        beta=0.5,
        rounds=2,
        clients=4,
        fraction=1.0,
        report_deadline_s=30,
    )
    fedmq.Simulation(cfg, moons(clients=4), run_dir=tmp_path / "fedmed").run()
    fedmed = rows(tmp_path / "fedmed")
    for row in fedmed:
        assert row["granted"] and set(row["received"]) == set(row["granted"]), row
        assert row["dropped"] == sorted(set(row["selected"]) - set(row["reported"])), row
    assert any(set(r["reported"]) - set(r["granted"]) for r in fedmed)  # reported, not granted: not drops
    cfg = fedmq.JobConfig(job="drop-async", strategy="async", rounds=2, clients=6, fraction=1.0)
    fedmq.Simulation(cfg, moons(clients=6), run_dir=tmp_path / "async").run()
    assert all(row["dropped"] == [] for row in rows(tmp_path / "async"))
