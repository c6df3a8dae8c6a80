"""FedAvg (θ = Σ n_k/n · θ_k) and FedSGD (the same average; the round config asks for one local pass).

FedSGD is a separate tiny class rather than a registry alias so that the engine can read the round
configuration it implies from ``round_config`` (all agents selected, one local epoch, full-batch-free SGD
step count left to the task) instead of special-casing a name.
"""

from __future__ import annotations

from typing import ClassVar, Mapping

import torch

from aggregator.strategies._common import cast_like, check_started, validate_update, zeros_like_state
from aggregator.strategies.base import ClientUpdate, State, Strategy


class FedAvg(Strategy):
    """Running n_k-weighted sum: one accumulator the size of the model, whatever the number of clients."""

    name: ClassVar[str] = "fedavg"

    def __init__(self) -> None:
        self._global: Mapping[str, torch.Tensor] | None = None
        self._acc: State = {}
        self._n = 0
        self._samples: dict[str, int] = {}
        self._last_weights: dict[str, float] = {}

    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        self._global = global_state
        self._acc = zeros_like_state(global_state)
        self._n = 0
        self._samples = {}

    def fold(self, update: ClientUpdate) -> None:
        g = check_started(self._global, self.name)
        validate_update(update, g)
        for name, t in update.tensors.items():
            self._acc[name].add_(t, alpha=update.n_samples)
        self._n += update.n_samples
        self._samples[update.client] = self._samples.get(update.client, 0) + update.n_samples

    def finish(self) -> State:
        g = check_started(self._global, self.name)
        if self._n == 0:
            out = {k: v.clone() for k, v in g.items()}
        else:
            out = cast_like({k: v.div_(self._n) for k, v in self._acc.items()}, g)
        self._last_weights = {c: n / self._n for c, n in self._samples.items()} if self._n else {}
        self._global, self._acc = None, {}
        return out


class FedSGD(FedAvg):
    """FedAvg over all agents after exactly one local pass; aggregation is identical to FedAvg."""

    name: ClassVar[str] = "fedsgd"
    round_config: ClassVar[dict] = {"select_all": True, "epochs": 1}
