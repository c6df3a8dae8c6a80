"""Server optimizers and client hooks against independent numpy implementations of the papers' algorithms, on
a small convex problem (docs/examples/logreg.py: logistic regression, full-batch local gradient descent): a
real in-process federation of 4 clients, every client every round, raw encodings both ways, 5 rounds; the
final global model equals the reference's to 1e-6."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import fedmq_procs
import numpy as np
import pytest

import fedmq
from fedmq.aggregator.checkpoint import load_checkpoint

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
sys.path.insert(0, str(EXAMPLES))
import logreg  # noqa: E402

CLIENTS, ROUNDS, STEPS, LR, SEED = 4, 5, 5, 0.5, 0


# ------------------------------------------------------------------------------------------ the references
def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-z))


def _local(theta: np.ndarray, x: np.ndarray, y: np.ndarray, mu: float = 0.0) -> np.ndarray:
    """STEPS of full-batch gradient descent on the mean logistic loss (+ μ/2‖w − θ‖²); θ = [weights, bias]."""
    x1 = np.hstack([x.astype(np.float64), np.ones((len(x), 1))])
    w = theta.copy()
    for _ in range(STEPS):
        g = x1.T @ (_sigmoid(x1 @ w) - y) / len(x) + mu * (w - theta)
        w = w - LR * g
    return w


def flat(state) -> np.ndarray:
    """A logistic-regression model as one float64 vector θ = [weights, bias]."""
    return np.concatenate(
        [state["weight"].detach().double().numpy()[0], state["bias"].detach().double().numpy()]
    )


def start(clients: int) -> tuple[logreg.LogReg, np.ndarray]:
    """The federation's task and the initial global model θ_0 (the task's model for the job's seed)."""
    task = logreg.LogReg(clients=clients, seed=SEED)
    return task, flat(task.build_model(SEED).state_dict())


def final_model(run: Path) -> np.ndarray:
    """The global model in a run folder's newest checkpoint."""
    return flat(load_checkpoint(run / "checkpoints").global_state)


def _rounds(
    server_step, mu: float = 0.0, clients: int = CLIENTS, rounds: int = ROUNDS, weighted: bool = True
) -> np.ndarray:
    task, theta = start(clients)
    n = np.array([len(x) if weighted else 1 for x, _ in task.shards], dtype=np.float64)
    for _ in range(rounds):
        local = [_local(theta, x, y, mu) for x, y in task.shards]
        average = sum(nk * w for nk, w in zip(n, local)) / n.sum()
        theta = server_step(theta, average - theta)
    return theta


def fedavg_ref(**shape) -> np.ndarray:
    return _rounds(lambda theta, delta: theta + delta, **shape)


def fedprox_ref(mu: float, **shape) -> np.ndarray:
    return _rounds(lambda theta, delta: theta + delta, mu, **shape)


def fedavgm_ref(server_lr: float, momentum: float, **shape) -> np.ndarray:
    m = None

    def step(theta, delta):
        nonlocal m
        m = delta if m is None else momentum * m + delta
        return theta + server_lr * m

    return _rounds(step, **shape)


def fedopt_ref(
    kind: str,
    server_lr: float,
    beta1: float,
    beta2: float,
    tau: float,
    v0: float | None = None,
    bias_correction: bool = False,
    **shape,
) -> np.ndarray:
    """Reddi et al. 2021, Algorithm 2, with m_{-1} = 0 and v_{-1} = τ² (or v0); with ``bias_correction``, η
    scaled at the t-th step by Adam's √(1 − β2^t)/(1 − β1^t) (Kingma and Ba 2015, Algorithm 1)."""
    state = {"t": 0}

    def step(theta, delta):
        state["t"] += 1
        t = state["t"]
        lr = server_lr * np.sqrt(1 - beta2**t) / (1 - beta1**t) if bias_correction else server_lr
        m = (1 - beta1) * delta + beta1 * state.get("m", 0.0)
        v = state.get("v", np.full_like(theta, tau**2 if v0 is None else v0))
        d2 = delta**2
        if kind == "adagrad":
            v = v + d2
        elif kind == "adam":
            v = beta2 * v + (1 - beta2) * d2
        else:  # yogi
            v = v - (1 - beta2) * d2 * np.sign(v - d2)
        state.update(m=m, v=v)
        return theta + lr * m / (np.sqrt(v) + tau)

    return _rounds(step, **shape)


def scaffold_ref(server_lr: float, clients: int = CLIENTS, rounds: int = ROUNDS) -> np.ndarray:
    """Karimireddy et al. 2020, Algorithm 1, option II; every client every round (|S| = N)."""
    task, theta = start(clients)
    c, c_i = np.zeros_like(theta), [np.zeros_like(theta) for _ in range(clients)]
    for _ in range(rounds):
        dy, dc = [], []
        for i, (x, y) in enumerate(task.shards):
            x1 = np.hstack([x.astype(np.float64), np.ones((len(x), 1))])
            w = theta.copy()
            for _ in range(STEPS):
                w = w - LR * (x1.T @ (_sigmoid(x1 @ w) - y) / len(x) - c_i[i] + c)
            new = c_i[i] - c + (theta - w) / (STEPS * LR)
            dy.append(w - theta)
            dc.append(new - c_i[i])
            c_i[i] = new
        theta = theta + server_lr * np.mean(dy, axis=0)
        c = c + np.sum(dc, axis=0) / clients
    return theta


# ------------------------------------------------------------------------------------------ fedmq
def run_fedmq(tmp_path: Path, strategy: str, **args) -> np.ndarray:
    cfg = fedmq.JobConfig(
        job="ref",
        strategy=strategy,
        strategy_args=args,
        rounds=ROUNDS,
        clients=CLIENTS,
        fraction=1.0,
        lr=LR,
        max_steps=STEPS,
        encoding="raw",
        down_encoding="raw",
        seed=SEED,
    )
    summary = fedmq.Simulation(cfg, logreg.LogReg(clients=CLIENTS, seed=SEED), run_dir=tmp_path / "run").run()
    assert summary["rounds_completed"] == ROUNDS
    return final_model(tmp_path / "run")


# (strategy, its parameters, its reference given the federation's shape: clients=, rounds=)
CASES = [
    ("fedavg", {}, fedavg_ref),
    ("scaffold", {"server_lr": 1.0}, lambda **s: scaffold_ref(1.0, **s)),
    ("fedprox", {"mu": 0.5}, lambda **s: fedprox_ref(0.5, **s)),
    ("fedavgm", {"server_lr": 1.0, "momentum": 0.9}, lambda **s: fedavgm_ref(1.0, 0.9, **s)),
    (
        "fedadagrad",
        {"server_lr": 0.1, "beta1": 0.9, "tau": 1e-2},
        lambda **s: fedopt_ref("adagrad", 0.1, 0.9, 0, 1e-2, **s),
    ),
    (
        "fedadam",
        {"server_lr": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 1e-2},
        lambda **s: fedopt_ref("adam", 0.1, 0.9, 0.99, 1e-2, **s),
    ),
    (
        "fedyogi",
        {"server_lr": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 1e-2},
        lambda **s: fedopt_ref("yogi", 0.1, 0.9, 0.99, 1e-2, **s),
    ),
    # the switches for a job ported from Flower: Adam's bias correction, v starting at 0, the plain mean
    (
        "fedadam",
        {"server_lr": 0.1, "tau": 1e-2, "bias_correction": True, "initial_v": 0.0, "weighted": False},
        lambda **s: fedopt_ref(
            "adam", 0.1, 0.9, 0.99, 1e-2, v0=0.0, bias_correction=True, weighted=False, **s
        ),
    ),
    (
        "fedavgm",
        {"server_lr": 1.0, "momentum": 0.5, "weighted": False},
        lambda **s: fedavgm_ref(1.0, 0.5, weighted=False, **s),
    ),
]


IDS = [f"{c[0]}-flower" if "weighted" in c[1] else c[0] for c in CASES]


@pytest.mark.parametrize(("strategy", "args", "reference"), CASES, ids=IDS)
def test_strategy_matches_its_numpy_reference(tmp_path, strategy, args, reference):
    ours, theirs = run_fedmq(tmp_path, strategy, **args), reference()
    assert np.abs(ours - theirs).max() < 1e-6, (ours, theirs)
    # the strategy's parameters matter: the reference of plain FedAvg is elsewhere
    if strategy != "fedavg":
        assert np.abs(theirs - fedavg_ref()).max() > 1e-3
    # and so do the switches for a ported job: the default form of the same strategy is elsewhere
    if "weighted" in args:
        default = next(ref for name, a, ref in CASES if name == strategy and "weighted" not in a)
        assert np.abs(theirs - default()).max() > 1e-3


@pytest.mark.parametrize(("strategy", "args", "reference"), CASES[1:], ids=IDS[1:])
def test_strategy_runs_from_the_command_line(tmp_path, strategy, args, reference):
    """`fedmq simulate --strategy NAME --strategy-arg KEY=VALUE ...`: the same numbers as from Python."""
    rounds = 2
    flags = [f for k, v in args.items() for f in ("--strategy-arg", f"{k}={str(v).lower()}")]
    cmd = fedmq_procs.command(
        "simulate",
        "--task",
        "logreg:LogReg",
        "--strategy",
        strategy,
        *flags,
        "-k",
        str(CLIENTS),
        "-c",
        "1",
        "-r",
        str(rounds),
        "--lr",
        str(LR),
        "--max-steps",
        str(STEPS),
        "--encoding",
        "raw",
        "--down-encoding",
        "raw",
        "--out",
        str(tmp_path / "run"),
        "--json",
    )
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES), "OMP_NUM_THREADS": "1"}
    done = fedmq_procs.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert np.abs(final_model(tmp_path / "run") - reference(rounds=rounds)).max() < 1e-6
