"""The influence guard (aggregator.guards) departs from textbook FedAvg when one client holds far more
samples than the others (skewed natural shards): it caps that client's weight. The run says so, in its
summary and in the final table's caption, and `--max-samples-factor 0` (JobConfig.max_samples_factor = 0)
turns the cap off: weights n_k / Σ n, as McMahan et al."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import fedmq
from fedmq.cli.status import summary_caption

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.fixture(scope="module")
def skewed():
    sys.path.insert(0, str(EXAMPLES))
    try:
        from bring_your_own import TwoMoons
    finally:
        sys.path.remove(str(EXAMPLES))

    class Skewed(TwoMoons):
        """Client 3 holds ten times the points of each other client."""

        def __init__(self, clients: int = 4, seed: int = 0) -> None:
            super().__init__(clients, seed, points=100)
            x, y = self.shards[3]
            self.shards[3] = (x.repeat(10, 1), y.repeat(10))

    return Skewed


def run(tmp_path: Path, task, name: str, **job) -> tuple[dict, list[dict]]:
    cfg = fedmq.JobConfig(
        job=name, rounds=2, clients=4, fraction=1.0, lr=0.5, batch_size=16, max_steps=5, **job
    )
    summary = fedmq.Simulation(cfg, task, run_dir=tmp_path / name).run()
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def test_the_summary_says_when_the_guard_capped_and_a_flag_turns_it_off(tmp_path, skewed):
    summary, rows = run(tmp_path, skewed(), "guarded")
    assert summary["guard"] == {"rounds": 2, "capped": 2, "dropped": 0}
    assert json.loads((tmp_path / "guarded" / "summary.json").read_text())["guard"] == summary["guard"]
    assert all(list(r["guard"]["capped"]) == ["agent-3"] for r in rows)
    assert all(r["weights"]["agent-3"] == pytest.approx(400 / 700) for r in rows)  # capped at 4 x 100
    assert "influence guard capped 2 update(s) in 2 round(s)" in summary_caption(summary)

    summary, rows = run(tmp_path, skewed(), "textbook", max_samples_factor=0)
    assert summary["guard"] == {"rounds": 0, "capped": 0, "dropped": 0}
    assert all(r["weights"]["agent-3"] == pytest.approx(1000 / 1300) for r in rows)  # n_k / sum n
    assert "influence guard" not in summary_caption(summary)


@pytest.mark.parametrize(
    ("job", "ahead_from"),
    [
        ({"beta": 0.9}, 1),  # top-K with β = 0.9 (all four granted): round 1 from the reports, then history
        ({}, 2),  # no grant phase: round 1 is capped at its close and folded again; round 2 from the history
    ],
)
def test_a_capped_round_is_folded_once_and_to_the_same_bits(tmp_path, skewed, monkeypatch, job, ahead_from):
    """A synchronous round that knows its weight cap before its updates come (the granted clients' reports,
    or the earlier rounds' reference) caps them as they are folded, so an honest skewed round is not folded a
    second time from its spool; the model is the one the second pass gives, bit for bit."""
    from fedmq.aggregator.checkpoint import load_checkpoint
    from fedmq.aggregator.engine import Engine
    from fedmq.aggregator.guards import RoundGuard

    passes: list[int] = []
    refold = Engine._refold
    monkeypatch.setattr(
        Engine, "_refold", lambda self, stats, *a: passes.append(stats.round) or refold(self, stats, *a)
    )
    _, rows = run(tmp_path, skewed(), "ahead", **job)
    assert passes == list(range(1, ahead_from)) and all(
        list(r["guard"]["capped"]) == ["agent-3"] for r in rows
    )

    passes.clear()
    monkeypatch.setattr(RoundGuard, "expect", lambda self, claims: None)  # no cap ahead: capped at the close
    _, again = run(tmp_path, skewed(), "second-pass", **job)
    assert passes == [1, 2] and [r["weights"] for r in again] == [r["weights"] for r in rows]
    ahead = load_checkpoint(tmp_path / "ahead" / "checkpoints")
    second = load_checkpoint(tmp_path / "second-pass" / "checkpoints")
    assert ahead is not None and second is not None and ahead.model_version == second.model_version == 2
    a, b = ahead.global_state, second.global_state
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_simulate_has_the_flag():
    import typer

    from fedmq.cli.app import app
    from fedmq.cli.commands.simulate import simulate
    from fedmq.cli.simulate_options import from_context

    command = typer.main.get_command(app).commands["simulate"]
    ctx = command.make_context("simulate", ["--max-samples-factor", "0"])
    assert from_context(ctx, simulate).job.max_samples_factor == 0
