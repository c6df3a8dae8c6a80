"""FedAvgM: FedAvg with server momentum (Hsu, Qi and Brown 2019, "Measuring the Effects of Non-Identical Data
Distribution for Federated Visual Classification").

Each round the server averages the clients' models as FedAvg does (n_k-weighted) and treats the change
Δ_t = θ̄_t − θ_t as a step: m_t = β·m_{t−1} + Δ_t, θ_{t+1} = θ_t + η·m_t (m_{−1} = 0). With β = 0 and η = 1
it is FedAvg. The momentum buffer m is the strategy's state: checkpointed every round, restored after a crash.

Parameters (``--strategy-arg``): ``server_lr`` η (default 1), ``momentum`` β (0.5: at 0.9 the default job's
validation perplexity rose from round 1 to 2 and again at 5; Flower's default is 0, which is FedAvg),
``weighted`` (true: Δ_t is the n_k-weighted mean; false: the plain mean over the round's clients).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from fedmq.aggregator.strategies._common import MAX_SERVER_LR
from fedmq.aggregator.strategies.base import State
from fedmq.aggregator.strategies.fedavg import ServerStep
from fedmq.errors import BadParameter


class FedAvgM(ServerStep):
    name: ClassVar[str] = "fedavgm"
    per_tensor_state: ClassVar[tuple[str, ...]] = ("m",)

    def __init__(self, server_lr: float = 1.0, momentum: float = 0.5, weighted: bool = True) -> None:
        super().__init__(weighted=weighted)
        if not 0 < server_lr <= MAX_SERVER_LR:
            raise BadParameter(
                f"strategy 'fedavgm': server_lr must be in (0, {MAX_SERVER_LR}], got {server_lr}"
            )
        if not 0 <= momentum < 1:
            raise BadParameter(f"strategy 'fedavgm': momentum must be in [0, 1), got {momentum}")
        self.server_lr, self.momentum = server_lr, momentum
        self._m: State = {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._m = dict(state.get("m", {}))

    def state_dict(self) -> dict[str, Any]:
        return {"m": self._m}

    def step(self, name: str, theta: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        m = delta if name not in self._m else self.momentum * self._m[name] + delta
        self._m[name] = m
        return theta + self.server_lr * m
