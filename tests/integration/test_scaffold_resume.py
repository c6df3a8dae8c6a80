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


def _crash_and_resume(tmp_path: Path, run_args: list[str], point: str, rnd: int) -> Path:
    run = tmp_path / "run"
    crashed = killed(point, rnd, [*run_args, "--out", str(run)], tmp_path, _env())
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    ckpt = load_checkpoint(run / "checkpoints")
    assert ckpt is None or ckpt.round <= rnd + 1
    _fedmq("simulate", "--out", str(run), "--resume", cwd=tmp_path)  # the fit check knows scaffold.c:NAME
    assert _rounds(run) == list(range(1, ROUNDS + 1))  # no round lost, none twice
    return run


def _same_run(whole: Path, run: Path) -> None:
    a, b = load_checkpoint(whole / "checkpoints"), load_checkpoint(run / "checkpoints")
    assert a.round == b.round == ROUNDS + 1 and sorted(a.global_state) == sorted(b.global_state)
    assert all(torch.equal(a.global_state[k], b.global_state[k]) for k in a.global_state)
    assert a.mediator_state == b.mediator_state and a.strategy_state.keys() == b.strategy_state.keys()


@pytest.mark.parametrize(
    "point, rnd", [*((p, CRASH_ROUND) for p in POINTS), ("after-agg", 1), ("checkpoint-pending", 1)]
)
def test_scaffold_resumes_bit_for_bit_after_kill9(tmp_path, whole, point, rnd):
    run = _crash_and_resume(tmp_path, RUN, point, rnd)
    _same_run(whole, run)
    assert any(k.startswith("scaffold.c:") for k in load_checkpoint(run / "checkpoints").global_state)
    ours, theirs = _client_variates(whole), _client_variates(run)
    assert sorted(ours) == sorted(theirs) and ours
    for name, state in ours.items():
        assert all(torch.equal(state[k], theirs[name][k]) for k in state), name


FEDMED = [*RUN[:4], "fedmed", *RUN[5:]]


@pytest.fixture(scope="module")
def whole_fedmed(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("whole-fedmed")
    _fedmq(*FEDMED, "--out", str(base / "run"), cwd=base)
    return base / "run"


@pytest.mark.parametrize("point", ["during-agg", "checkpoint-pending"])
def test_fedmed_resumes_with_the_mediators_choices_after_kill9(tmp_path, whole_fedmed, point):
    """The mediator's step of a round that had chosen its strategy before the kill is kept in the round's
    spool: the resumed run makes the same choices and the same model."""
    run = _crash_and_resume(tmp_path, FEDMED, point, 2)
    _same_run(whole_fedmed, run)
    strategies = [
        [json.loads(line)["strategy"] for line in (r / "metrics.jsonl").read_text().splitlines()]
        for r in (whole_fedmed, run)
    ]
    assert strategies[0] == strategies[1]
