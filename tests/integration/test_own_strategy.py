"""A strategy with server state, parameters and a client hook, written outside the package in one file
(docs/examples/own_strategy.py), run from Python and by `fedmq simulate --strategy module:Class
--strategy-arg ...`, from a copy of that one file in a folder of its own: the final model equals a numpy
reference of the algorithm, and the strategy's state is in the checkpoint."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import fedmq_procs
import numpy as np
import pytest

import fedmq
from fedmq.aggregator.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
sys.path.insert(0, str(EXAMPLES))
sys.path.insert(0, str(Path(__file__).parent))
import test_strategy_references as refs  # noqa: E402

SERVER_LR, MAX_NORM = 1.0, 0.05


def reference() -> np.ndarray:
    """Clip each client's change to MAX_NORM, FedAvg's n_k-weighted mean, step η_t = SERVER_LR / √(t + 1)."""
    task, theta = refs.start(refs.CLIENTS)
    n = np.array([len(x) for x, _ in task.shards], dtype=np.float64)
    for t in range(refs.ROUNDS):
        deltas = [refs._local(theta, x, y) - theta for x, y in task.shards]
        deltas = [d * min(1.0, MAX_NORM / np.linalg.norm(d)) for d in deltas]
        theta = theta + SERVER_LR / np.sqrt(t + 1) * sum(nk * d for nk, d in zip(n, deltas)) / n.sum()
    return theta


@pytest.fixture
def own_module(tmp_path, monkeypatch):
    """The example file copied, alone, into a folder of its own under a name of its own."""
    folder = tmp_path / "mine"
    folder.mkdir()
    shutil.copy(EXAMPLES / "own_strategy.py", folder / "my_fl_strategy.py")
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    sys.modules.pop("my_fl_strategy", None)


def _final(run: Path) -> tuple[np.ndarray, dict]:
    """The final global model and the strategy state kept beside it."""
    ckpt = load_checkpoint(run / "checkpoints")
    return refs.flat(ckpt.global_state), ckpt.strategy_state


def test_from_python(tmp_path, own_module):
    cfg = fedmq.JobConfig(
        job="own",
        strategy="my_fl_strategy:DecayingFedAvg",
        strategy_args={"server_lr": SERVER_LR, "max_norm": MAX_NORM},
        rounds=refs.ROUNDS,
        clients=refs.CLIENTS,
        fraction=1.0,
        lr=refs.LR,
        max_steps=refs.STEPS,
        encoding="raw",
        down_encoding="raw",
    )
    fedmq.Simulation(cfg, refs.logreg.LogReg(clients=refs.CLIENTS), run_dir=tmp_path / "run").run()
    ours, state = _final(tmp_path / "run")
    assert np.abs(ours - reference()).max() < 1e-6
    assert state == {"my_fl_strategy:DecayingFedAvg": {"rounds": refs.ROUNDS}}
    # the clip is what makes the difference: without it (a large max_norm) the model is FedAvg's own
    assert np.abs(reference() - refs.fedavg_ref()).max() > 1e-3


def test_from_the_command_line(tmp_path, own_module):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(own_module), str(EXAMPLES)]),
        "OMP_NUM_THREADS": "1",
    }
    args = [
        "simulate",
        "--task",
        "logreg:LogReg",
        "--strategy",
        "my_fl_strategy:DecayingFedAvg",
        "--strategy-arg",
        f"server_lr={SERVER_LR}",
        "--strategy-arg",
        f"max_norm={MAX_NORM}",
        "-k",
        str(refs.CLIENTS),
        "-c",
        "1",
        "-r",
        str(refs.ROUNDS),
        "--lr",
        str(refs.LR),
        "--max-steps",
        str(refs.STEPS),
        "--encoding",
        "raw",
        "--down-encoding",
        "raw",
        "--out",
        str(tmp_path / "run"),
        "--json",
    ]
    done = fedmq_procs.run(
        fedmq_procs.command(*args),
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    ours, state = _final(tmp_path / "run")
    assert np.abs(ours - reference()).max() < 1e-6
    assert state["my_fl_strategy:DecayingFedAvg"] == {"rounds": refs.ROUNDS}
    # a parameter the strategy does not have is one line, and nothing runs
    bad = fedmq_procs.run(
        fedmq_procs.command(
            *args[:-3],
            "--strategy-arg",
            "maxnorm=1",
            "--out",
            str(tmp_path / "bad"),
        ),
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        cwd=tmp_path,
    )
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1] == (
        "error: strategy 'my_fl_strategy:DecayingFedAvg' has no parameter 'maxnorm'; "
        "it takes max_norm, server_lr"
    )
