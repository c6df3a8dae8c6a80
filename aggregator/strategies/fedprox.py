"""FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks"): each selected client
minimises its local objective plus a proximal term that keeps it near the global model it started from,

    h_k(w; w^t) = F_k(w) + μ/2 · ‖w − w^t‖²          (the paper's Eq. 2)

so its local steps follow ∇F_k(w) + μ(w − w^t). The client side is :class:`ProxHook`: it adds μ(w − w^t) to
every parameter's gradient at every local step, whatever the task's training loop. The server averages the
returned models as FedAvg does (n_k-weighted, as the authors' code does; the paper's Algorithm 2 samples
devices with probability p_k and averages them uniformly, which is the same in expectation). μ = 0 is FedAvg.

Parameter (``--strategy-arg mu=0.01``): ``mu`` μ in [0, 100] (default 0.01).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from fedmq.aggregator.strategies._common import MAX_MU
from fedmq.aggregator.strategies.fedavg import FedAvg
from fedmq.errors import BadParameter
from fedmq.hooks import ClientHook, Kept
from fedmq.tasks.base import TrainConfig


class ProxHook(ClientHook):
    """FedProx's client side: the proximal term's gradient μ(w − w^t)."""

    name: ClassVar[str] = "fedprox"

    def __init__(self, mu: float = 0.01) -> None:
        if not 0 <= mu <= MAX_MU:
            raise BadParameter(f"fedprox: mu must be >= 0 and <= {MAX_MU}, got {mu}")
        self.mu = mu
        self._start: dict[str, torch.Tensor] = {}

    def begin(self, global_state: Mapping[str, torch.Tensor], train: TrainConfig, kept: Kept) -> None:
        self._start = {k: v.detach().clone() for k, v in global_state.items()}

    def gradient(self, name: str, param: torch.Tensor) -> torch.Tensor | None:
        start = self._start[name]
        if start.device != param.device:
            start = self._start[name] = start.to(param.device)
        return self.mu * (param - start)


class FedProx(FedAvg):
    name: ClassVar[str] = "fedprox"
    client_hook: ClassVar[type[ClientHook] | None] = ProxHook

    def __init__(self, mu: float = 0.01) -> None:
        super().__init__()
        if not 0 <= mu <= MAX_MU:
            raise BadParameter(f"strategy 'fedprox': mu must be >= 0 and <= {MAX_MU}, got {mu}")
        self.mu = mu
