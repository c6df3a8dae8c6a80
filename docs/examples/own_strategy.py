"""A strategy of your own with server state, parameters and a client side, in one file.

The client side (``ClipUpdate``): each selected client clips its update to a norm of at most ``max_norm``
before uploading it (the client step of DP-FedAvg, McMahan et al. 2018, without the noise). The server side
(``DecayingFedAvg``): FedAvg's n_k-weighted mean of the clipped updates, applied with a server learning rate
that decays as η_t = ``server_lr`` / √(t + 1); the round count t is the strategy's state, so a restarted
aggregator goes on with the right η_t.

Run it (this folder on the Python path of every process that runs the job)::

    PYTHONPATH=docs/examples fedmq simulate --task logreg:LogReg --strategy own_strategy:DecayingFedAvg \\
        --strategy-arg server_lr=1.0 --strategy-arg max_norm=0.5 -k 4 -c 1 -r 5 --lr 0.5 --max-steps 5

or from Python: ``python docs/examples/own_strategy.py``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import fedmq


class ClipUpdate(fedmq.ClientHook):
    """Upload θ + Δ·min(1, max_norm / ‖Δ‖), Δ the client's change over all its tensors."""

    name = "clip-update"

    def __init__(self, max_norm: float = 1.0) -> None:
        if not max_norm > 0:
            raise fedmq.BadParameter(f"max_norm must be positive, got {max_norm}")
        self.max_norm = max_norm

    def begin(
        self, global_state: Mapping[str, torch.Tensor], train: fedmq.TrainConfig, kept: fedmq.Kept
    ) -> None:
        self.start = {k: v.detach().clone() for k, v in global_state.items()}

    def finish(self, trained: fedmq.State, result: fedmq.TrainResult, kept: fedmq.Kept) -> fedmq.State:
        delta = {k: v - self.start[k] for k, v in trained.items()}
        norm = math.sqrt(sum(float((d.double() ** 2).sum()) for d in delta.values()))
        scale = min(1.0, self.max_norm / norm) if norm > 0 else 1.0
        return {k: self.start[k] + scale * d for k, d in delta.items()}


class DecayingFedAvg(fedmq.FedAvg):
    """FedAvg's mean update applied at η_t = server_lr / √(t + 1); its clients run ClipUpdate."""

    name = "decaying-fedavg"
    client_hook = ClipUpdate

    def __init__(self, server_lr: float = 1.0, max_norm: float = 1.0) -> None:
        super().__init__()
        self.server_lr, self.rounds = server_lr, 0

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rounds = int(state.get("rounds", 0))

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds}

    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        super().begin(global_state)
        self.base = global_state

    def finish(self) -> fedmq.State:
        base, folded = self.base, self._n > 0
        average = super().finish()
        if not folded:
            return average
        lr = self.server_lr / math.sqrt(self.rounds + 1)
        self.rounds += 1
        return {k: theta + lr * (average[k] - theta) for k, theta in base.items()}


def main(run_dir: Path) -> dict:
    from logreg import LogReg  # the convex task beside this file

    cfg = fedmq.JobConfig(
        job="own-strategy",
        strategy=f"{__name__}:DecayingFedAvg",
        strategy_args={"server_lr": 1.0, "max_norm": 0.5},
        rounds=5,
        clients=4,
        fraction=1.0,
        lr=0.5,
        max_steps=5,
    )
    return fedmq.Simulation(cfg, LogReg(clients=4), run_dir=run_dir).run()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    summary = main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/own-strategy"))
    print(f"validation loss after {summary['rounds_completed']} rounds: {summary['best_valid']:.4f}")
