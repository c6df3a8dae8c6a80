"""An asynchronous job's first buffer, whose updates have no reference and are held until its close
(aggregator.guards.RoundGuard.judge_held), under `fedmq simulate` killed with SIGKILL once its first update
is spooled (tests/integration/crash_at.py, ``during-agg``) and continued with --resume: version 1 is the
uninterrupted run's (the same updates judged the same way; folded in another order, so equal to float
rounding), and so is its row's guard verdict."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import fedmq_procs
import pytest
import torch

from fedmq.aggregator.checkpoint import load_checkpoint

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from crash_at import killed  # noqa: E402

pytestmark = pytest.mark.slow
EXAMPLES = HERE.parents[1] / "docs" / "examples"
# two-moons' first steps move its model ~50x its norm: judged one by one with no reference they were
# shortened (before; the third update was then rejected against the first two) or dropped; judged together,
# the buffer's median keeps them all
RUN = [
    "simulate",
    "--task",
    "bring_your_own:TwoMoons",
    "--strategy",
    "async",
    "--strategy-arg",
    "buffer_size=3",
    "-k",
    "3",
    "-c",
    "1",
    "-r",
    "1",
    "--encoding",
    "raw",
    "--down-encoding",
    "raw",
]


def _env() -> dict[str, str]:  # the example's module importable, one thread
    return {**os.environ, "PYTHONPATH": str(EXAMPLES), "OMP_NUM_THREADS": "1"}


def _first_row(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r.get("round") == 1]
    return row


def _simulate(*args: str, cwd: Path) -> None:
    done = fedmq_procs.fedmq(*args, cwd=cwd, env=_env(), timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_restart_inside_the_first_buffer_gives_the_same_version_1(tmp_path):
    whole = tmp_path / "whole"
    _simulate(*RUN, "--out", str(whole), cwd=tmp_path)
    run = tmp_path / "run"
    crashed = killed("during-agg", 1, [*RUN, "--out", str(run)], tmp_path, _env())
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert len(list((run / "spool" / "r000001").glob("update-*.msg"))) == 1  # killed inside the buffer
    _simulate("simulate", "--out", str(run), "--resume", cwd=tmp_path)
    a, b = _first_row(whole), _first_row(run)
    assert sorted(a["received"]) == sorted(b["received"]) == ["agent-0", "agent-1", "agent-2"], (a, b)
    assert a.get("guard") == b.get("guard") and a["weights"] == pytest.approx(b["weights"], rel=1e-6)
    x, y = load_checkpoint(whole / "checkpoints"), load_checkpoint(run / "checkpoints")
    assert x.global_state.keys() == y.global_state.keys()
    for name, value in x.global_state.items():
        assert torch.allclose(value, y.global_state[name], rtol=1e-5, atol=1e-6), name
