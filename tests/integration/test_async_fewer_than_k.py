"""Asynchronous mode with fewer agents online than the buffer (buffer_size): a version is folded once
nobody else can arrive, not when the report and update deadlines run out.

Three clients, buffer_size 3, and a trace that keeps agent-2 offline in every slot: two agents are ever
online, so no version can reach three updates. Before the aggregator folded what it had, each version waited
for both deadlines (60 s + 60 s then) and three versions took six minutes; now each is folded as soon as the
two online agents have delivered. The deadlines here are ten minutes each, far beyond what a version takes on
a busy machine: a version that waited for them is told apart by its own wall_s.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
from load_factor import budget

import fedmq

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
LIMIT_S = 45.0  # an idle machine's seconds for the whole run (about 7 s), far below one version's deadline
DEADLINE_S = 600.0


@pytest.fixture(scope="module")
def moons():
    sys.path.insert(0, str(EXAMPLES))
    try:
        from bring_your_own import TwoMoons
    finally:
        sys.path.remove(str(EXAMPLES))
    return TwoMoons


def test_async_folds_what_it_has_when_fewer_than_buffer_size_are_online(tmp_path, moons):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"agent-2": []}))
    cfg = fedmq.JobConfig(
        job="async-few",
        strategy="async",
        rounds=3,
        clients=3,
        fraction=1.0,
        strategy_args={"buffer_size": 3},
        report_deadline_s=DEADLINE_S,
        update_deadline_s=DEADLINE_S,
    )
    sim = fedmq.Simulation(cfg, moons(clients=3), run_dir=tmp_path / "run", availability=f"trace:{trace}")
    stop = threading.Event()
    out: dict = {}
    runner = threading.Thread(target=lambda: out.update(sim.run(stop=stop)), daemon=True)
    runner.start()
    runner.join(budget(LIMIT_S))
    stalled = runner.is_alive()
    if stalled:  # end the run (its deadlines would take minutes) before failing
        stop.set()
        runner.join(budget(180))
    assert not stalled, f"3 versions took more than {budget(LIMIT_S):.0f} s: each waited for its deadlines"
    assert out["version"] == 3, out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "round" in r]
    assert len(rows) == 3 and not any(r["skipped"] for r in rows), rows
    for row in rows:
        # the never-available agent contributed nothing; two agents online: a version folds what they
        # sent (one may send twice into a version: a stale update, then its fresh one), never agent-2's
        assert len(row["received"]) >= 1 and "agent-2" not in row["received"], row
        # folded once nobody else could arrive, before the version's report deadline (the run's own record)
        assert row["wall_s"] < cfg.report_deadline_s, row
