"""A small convex task: logistic regression on synthetic data, each client a shard of its own size and skew.

Local training is full-batch gradient descent (``cfg.max_steps`` steps, or ``cfg.epochs``, at ``cfg.lr``), so
a round is deterministic and easy to write again in a few lines of numpy: the strategy guide and the tests use
it to check server optimizers and client hooks against independent reference implementations.

    PYTHONPATH=docs/examples fedmq simulate --task logreg:LogReg --strategy fedprox --strategy-arg mu=0.1 \\
        -k 4 -c 1 -r 5 --lr 0.5 --max-steps 5 --encoding raw --down-encoding raw
"""

from __future__ import annotations

import time

import numpy as np
import torch

import fedmq


def make_shards(clients: int, seed: int, dim: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """Client k holds 20 + 10·k points whose labels follow a shared true direction plus a skew of its own;
    returns the shards (x, y) and the true weights."""
    rng = np.random.RandomState(seed)
    w_true = rng.normal(size=dim)
    shards = []
    for k in range(clients):
        n = 20 + 10 * k
        x = rng.normal(size=(n, dim)) + 0.5 * rng.normal(size=dim)  # each client's inputs are shifted
        p = 1 / (1 + np.exp(-(x @ w_true)))
        shards.append((x.astype(np.float32), (rng.uniform(size=n) < p).astype(np.float32)))
    return shards, w_true


class LogReg(fedmq.Task):
    name = "logreg"
    metric = "loss"
    higher_is_better = False

    def __init__(self, clients: int = 4, seed: int = 0, dim: int = 5) -> None:
        self.dim = dim
        self.shards, w_true = make_shards(clients, seed, dim)
        rng = np.random.RandomState(seed + 1)
        x = rng.normal(size=(200, dim)).astype(np.float32)
        self.valid = (x, (x @ w_true > 0).astype(np.float32))

    def build_model(self, seed: int = 0) -> torch.nn.Module:
        model = torch.nn.Linear(self.dim, 1)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            model.weight.copy_(0.1 * torch.randn(1, self.dim, generator=g))
            model.bias.zero_()
        return model

    def groups(self) -> dict[str, str]:
        return {"weight": "model", "bias": "model"}

    @property
    def num_clients(self) -> int:
        return len(self.shards)

    def train(
        self,
        model: torch.nn.Module,
        client: int,
        cfg: fedmq.TrainConfig,
        progress: fedmq.Progress | None = None,
    ) -> fedmq.TrainResult:
        """Full-batch gradient descent on the mean logistic loss of this client's shard."""
        x, y = (torch.from_numpy(a) for a in self.shards[client])
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        steps = cfg.max_steps or cfg.epochs
        t0, total = time.perf_counter(), 0.0
        for _ in range(steps):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        return fedmq.TrainResult(
            loss=total / steps, n_samples=len(x), steps=steps, tokens=len(x), seconds=time.perf_counter() - t0
        )

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, split: str = "valid") -> float:
        x, y = (torch.from_numpy(a) for a in self.valid)
        return float(torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(1), y))
