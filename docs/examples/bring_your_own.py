"""Bring your own model, data and aggregation to fedmq: a Task and a Strategy of your own.

The task: classify points of two interleaved half-moons (2-D, noisy) with a small MLP; each client holds a
skewed share of the points (client k sees mostly one class when k is even, the other when odd). The strategy:
an unweighted mean of the clients' models, where FedAvg weighs each by its number of samples.

Run it (an aggregator and 8 agents in one process, over the in-process broker; a few seconds on a laptop)::

    python docs/examples/bring_your_own.py [RUN_DIR]

(a RUN_DIR that holds a run already is refused: ``Simulation(..., resume=True)`` continues one)

or from the command line, with this folder on the Python path (every process that runs the job needs it)::

    PYTHONPATH=docs/examples fedmq simulate --task bring_your_own:TwoMoons \\
        --strategy bring_your_own:UniformMean -k 8 -r 5 --lr 0.5 -b 16

As services, name the same classes in the job file (``strategy = "bring_your_own:UniformMean"`` and, under
``[task]``, ``task = "bring_your_own:TwoMoons"``) and start ``fedmq aggregator run`` and ``fedmq agent run``
with the module on their Python path.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch

import fedmq


class TwoMoons(fedmq.Task):
    name = "two-moons"
    metric = "accuracy"
    higher_is_better = True

    def __init__(self, clients: int = 8, seed: int = 0, points: int = 200) -> None:
        """``clients``, ``seed``: fedmq passes these (and any other option this constructor names) from the
        command line or the job file; ``points`` per client."""
        g = torch.Generator().manual_seed(1000 + seed)
        self.shards = [self._moons(points, g, skew=0.8 if k % 2 == 0 else 0.2) for k in range(clients)]
        self.splits = {"valid": self._moons(500, g, skew=0.5), "test": self._moons(500, g, skew=0.5)}

    @staticmethod
    def _moons(n: int, g: torch.Generator, skew: float) -> tuple[torch.Tensor, torch.Tensor]:
        y = (torch.rand(n, generator=g) > skew).long()  # P(class 0) = skew
        angle = torch.rand(n, generator=g) * math.pi
        x = torch.stack([torch.cos(angle), torch.sin(angle)], 1)
        x = torch.where(y[:, None] == 1, torch.stack([1 - x[:, 0], 0.5 - x[:, 1]], 1), x)
        return x + 0.15 * torch.randn(n, 2, generator=g), y

    def build_model(self, seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))

    def groups(self) -> dict[str, str]:
        return {name: "model" for name, _ in self.build_model().named_parameters()}

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
        """Plain SGD on this client's shard with the job's lr, batch size, epochs and step cap."""
        x, y = self.shards[client]
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        g = torch.Generator().manual_seed(cfg.seed)
        t0, steps, total = time.perf_counter(), 0, 0.0
        for _ in range(cfg.epochs):
            for idx in torch.randperm(len(x), generator=g).split(cfg.batch_size):
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                steps, total = steps + 1, total + loss.item()
                if cfg.max_steps and steps >= cfg.max_steps:
                    break
        return fedmq.TrainResult(
            loss=total / max(steps, 1),
            n_samples=len(x),
            steps=steps,
            tokens=len(x),
            seconds=time.perf_counter() - t0,
        )

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, split: str = "valid") -> float:
        x, y = self.splits[split]
        return float((model(x).argmax(1) == y).float().mean())


class UniformMean(fedmq.Strategy):
    """θ = mean_k θ_k, every client counted once (FedAvg: Σ n_k θ_k / Σ n_k). Streaming: one running sum.

    It owns its round as well (Flower's configure_train): its ``plan`` has every client train each round,
    whatever the job's fraction C, and ``configure_train`` asks each for two local epochs."""

    name = "uniform-mean"
    plan = fedmq.RoundPlan(select_all=True)

    @classmethod
    def configure_train(cls, train: fedmq.TrainConfig) -> fedmq.TrainConfig:
        return dataclasses.replace(train, epochs=2)

    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        self.base = global_state
        self.sums = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in global_state.items()}
        self.counts = dict.fromkeys(global_state, 0)
        self.clients: list[str] = []

    def fold(self, update: fedmq.ClientUpdate) -> None:
        # an update holds the client's weights, or (update.delta) their change from the global model it
        # started from; under dynamic pulling only some tensors
        for name, t in update.tensors.items():
            self.sums[name] += t.float() + (self.base[name].float() if update.delta else 0)
            self.counts[name] += 1
        self.clients.append(update.client)

    def finish(self) -> fedmq.State:
        self._last_weights = {c: 1 / len(self.clients) for c in self.clients}
        return {
            k: (self.sums[k] / self.counts[k]).to(v.dtype) if self.counts[k] else v.clone()
            for k, v in self.base.items()
        }


def main(run_dir: Path) -> dict:
    cfg = fedmq.JobConfig(
        job="byo",
        strategy=f"{__name__}:UniformMean",
        rounds=5,
        clients=8,
        fraction=0.25,
        lr=0.5,
        batch_size=16,
    )

    def progress(row: dict) -> None:  # each round's record (a metrics.jsonl row), as the round closes
        print(f"round {row['round']}: accuracy {row['valid']}, {len(row['received'])} update(s)")

    summary = fedmq.Simulation(cfg, TwoMoons(clients=8), run_dir=run_dir, on_round=progress).run()
    print(
        f"accuracy after {summary['rounds_completed']} rounds: valid {summary['best_valid']:.3f} "
        f"(round {summary['best_round']}), test {summary['test']:.3f}; the run is in {run_dir}"
    )
    return summary


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/bring-your-own"))
    except fedmq.FedmqError as exc:  # e.g. the run folder holds a run already (fedmq.RunFolderInUse)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
