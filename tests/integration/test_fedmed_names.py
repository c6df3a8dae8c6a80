"""FedMed and its variants by name from the command line: `fedmq simulate --strategy NAME` runs ``fedmed``
(the paper's JS weights), ``fedmed-relative`` and ``fedmed-standardised``, and each run's global model equals
an independent numpy computation of that weighting (logistic regression, docs/examples/logreg.py: full-batch
local gradient descent, every client every round, raw encodings, the loss switch kept adaptive)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import fedmq_procs
import numpy as np
import pytest

from fedmq.aggregator.checkpoint import load_checkpoint

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
sys.path.insert(0, str(EXAMPLES))
import logreg  # noqa: E402

CLIENTS, ROUNDS, STEPS, LR, SEED = 4, 2, 5, 0.5, 0
NAMES = ("fedmed", "fedmed-relative", "fedmed-standardised")


def _flat(state) -> np.ndarray:
    return np.concatenate(
        [state["weight"].detach().double().numpy()[0], state["bias"].detach().double().numpy()]
    )


def _local(theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    x1 = np.hstack([x.astype(np.float64), np.ones((len(x), 1))])
    w = theta.copy()
    for _ in range(STEPS):
        w = w - LR * x1.T @ (1 / (1 + np.exp(-(x1 @ w))) - y) / len(x)
    return w


def _js(a: np.ndarray, b: np.ndarray) -> float:
    """JS(softmax(a) ‖ softmax(b)) = KL(p ‖ m)/2 + KL(q ‖ m)/2, m = (p + q)/2 (FedMed Eq. 2)."""
    p, q = np.exp(a - a.max()), np.exp(b - b.max())
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2
    return float(np.sum(p * np.log(p / m)) / 2 + np.sum(q * np.log(q / m)) / 2)


def reference(name: str) -> np.ndarray:
    """ROUNDS rounds of FedMed's adaptive aggregation (η = 1) per tensor (weight, bias): γ = softmax(s) of
    s_k = d_k (the paper, Eq. 3), d_k / mean d (relative) or d_k / sd d (standardised; the mean cancels);
    ``mean``: equal weights."""
    task = logreg.LogReg(clients=CLIENTS, seed=SEED)
    theta = _flat(task.build_model(SEED).state_dict())
    tensors = [slice(0, len(theta) - 1), slice(len(theta) - 1, len(theta))]
    for _ in range(ROUNDS):
        local = [_local(theta, x, y) for x, y in task.shards]
        new = theta.copy()
        for t in tensors:
            d = np.array([_js(theta[t], w[t]) for w in local])
            scale = {"fedmed": 1.0, "fedmed-relative": d.mean(), "fedmed-standardised": d.std(), "mean": 0}[
                name
            ]
            s = d / scale if scale > 0 else np.zeros_like(d)
            gamma = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            new[t] = sum(g * w[t] for g, w in zip(gamma, local))
        theta = new
    return theta


@pytest.mark.parametrize("name", NAMES)
def test_each_fedmed_weighting_runs_by_its_name(tmp_path, name):
    run = tmp_path / "run"
    cmd = [
        *fedmq_procs.command("simulate", "--task", "logreg:LogReg", "--strategy", name),
        *("-k", str(CLIENTS), "-c", "1", "-r", str(ROUNDS), "--lr", str(LR), "--max-steps", str(STEPS)),
        *("--loss-eps", "0", "--encoding", "raw", "--down-encoding", "raw", "--out", str(run), "--json"),
    ]
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES), "OMP_NUM_THREADS": "1"}
    done = fedmq_procs.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((run / "config.json").read_text())["strategy"] == name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # ε = 0: the mediator keeps the adaptive aggregation every round, under the name the job gave
    assert [r["strategy"] for r in rows] == [name] * ROUNDS
    ours = _flat(load_checkpoint(run / "checkpoints").global_state)
    assert np.abs(ours - reference(name)).max() < 1e-6, (ours, reference(name))
    # the three weightings and an unweighted mean are four different models on this federation
    for other in (*NAMES, "mean"):
        if other != name:
            assert np.abs(reference(other) - reference(name)).max() > 1e-5, other
