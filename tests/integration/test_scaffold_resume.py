"""SCAFFOLD under `fedmq simulate`, killed with SIGKILL at each crash point of a round (tests/integration/
crash_at.py) and continued with --resume: the run ends with the uninterrupted run's model, server control
variate and clients' control variates, bit for bit."""

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
from crash_at import POINTS, killed  # noqa: E402

pytestmark = pytest.mark.slow
EXAMPLES = HERE.parents[1] / "docs" / "examples"
ROUNDS, CRASH_ROUND = 4, 3
RUN = [
    "simulate",
    "--task",
    "logreg:LogReg",
    "--strategy",
    "scaffold",
    "-k",
    "4",
    "-c",
    "1",
    "-r",
    str(ROUNDS),
    "--lr",
    "0.5",
    "--max-steps",
    "5",
    "--encoding",
    "raw",
    "--down-encoding",
    "raw",
]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(EXAMPLES), "OMP_NUM_THREADS": "1"}


def _fedmq(*args: str, cwd: Path) -> None:
    done = fedmq_procs.run(
        fedmq_procs.command(*args), capture_output=True, text=True, env=_env(), timeout=240, cwd=cwd
    )
    assert done.returncode == 0, done.stderr[-2000:]


def _client_variates(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: torch.load(p, weights_only=True)["state"] for p in sorted((run / "clients").glob("*.pt"))}


def _rounds(run: Path) -> list[int]:
    return [json.loads(line)["round"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("whole")
    _fedmq(*RUN, "--out", str(base / "run"), cwd=base)
    return base / "run"


@pytest.mark.parametrize("point", POINTS)
def test_scaffold_resumes_bit_for_bit_after_kill9(tmp_path, whole, point):
    run = tmp_path / "run"
    crashed = killed(point, CRASH_ROUND, [*RUN, "--out", str(run)], tmp_path, _env())
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert load_checkpoint(run / "checkpoints").round <= CRASH_ROUND + 1
    _fedmq("simulate", "--out", str(run), "--resume", cwd=tmp_path)  # the fit check knows scaffold.c:NAME
    assert _rounds(run) == list(range(1, ROUNDS + 1))  # no round lost, none twice
    a, b = load_checkpoint(whole / "checkpoints"), load_checkpoint(run / "checkpoints")
    assert a.round == b.round == ROUNDS + 1 and sorted(a.global_state) == sorted(b.global_state)
    assert any(k.startswith("scaffold.c:") for k in b.global_state)
    assert all(torch.equal(a.global_state[k], b.global_state[k]) for k in a.global_state)
    ours, theirs = _client_variates(whole), _client_variates(run)
    assert sorted(ours) == sorted(theirs) and ours
    for name, state in ours.items():
        assert all(torch.equal(state[k], theirs[name][k]) for k in state), name
