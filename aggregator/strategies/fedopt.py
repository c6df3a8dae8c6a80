"""Adaptive server optimizers: FedAdagrad, FedAdam and FedYogi (Reddi et al. 2021, "Adaptive Federated
Optimization", Algorithm 2).

Each round the server averages the clients' models as FedAvg does and takes Δ_t = θ̄_t − θ_t as a
pseudo-gradient for one step of an adaptive optimizer, per coordinate:

    m_t = β1·m_{t−1} + (1 − β1)·Δ_t
    v_t = v_{t−1} + Δ_t²                                   FedAdagrad
    v_t = v_{t−1} − (1 − β2)·Δ_t²·sign(v_{t−1} − Δ_t²)      FedYogi
    v_t = β2·v_{t−1} + (1 − β2)·Δ_t²                        FedAdam
    θ_{t+1} = θ_t + η·m_t / (√v_t + τ)

with m_{−1} = 0 and v_{−1} = τ² (the paper asks v_{−1} ≥ τ²), and no bias correction, as in the paper. Our
Δ_t is FedAvg's n_k-weighted mean of the clients' changes; Algorithm 2 writes the unweighted mean, which is
the same when the clients' shards are equal (``weighted=false`` takes the plain mean). m, v and the step
count are the strategy's state: checkpointed every round and restored after a crash, so a resumed job takes
exactly the steps it would have taken.

Parameters (``--strategy-arg``): ``server_lr`` η (default 0.2; FedAdagrad 1.0: its v only grows, so its
steps shrink from the start), ``beta1`` (0.9; FedAdagrad 0), ``beta2`` (0.99; FedAdagrad has none), ``tau``
τ, the adaptivity (1e-3; FedAdagrad 0.3: a coordinate whose accumulated changes stay well below τ steps by
about η/(2τ) times its change, as √v + τ ≈ 2τ there, and only the large ones are damped; with τ = 1e-3 every
coordinate that moved at all took a first step of about η·(1 − β1), shrinking from there, and it trained far
worse on PTB: docs/guide/strategy.md "Defaults, as swept"), and for a job ported from Flower:
``bias_correction`` (false; true scales η by √(1 − β2^t)/(1 − β1^t) at the t-th step, Adam's correction,
which Flower's FedAdam applies with t = round + 1), ``initial_v`` (v_{−1}; default τ², Flower starts at 0)
and ``weighted`` (true).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from fedmq.aggregator.strategies._common import MAX_SERVER_LR, TAU_RANGE
from fedmq.aggregator.strategies.base import State
from fedmq.aggregator.strategies.fedavg import ServerStep
from fedmq.errors import BadParameter


class FedOpt(ServerStep):
    """The common step; subclasses say how v_t moves (``second_moment``)."""

    name: ClassVar[str] = "fedopt"
    per_tensor_state: ClassVar[tuple[str, ...]] = ("m", "v")

    def __init__(
        self,
        server_lr: float = 0.2,
        beta1: float = 0.9,
        beta2: float = 0.99,
        tau: float = 1e-3,
        bias_correction: bool = False,
        initial_v: float | None = None,
        weighted: bool = True,
    ) -> None:
        super().__init__(weighted=weighted)
        v0 = tau * tau if initial_v is None else initial_v  # (not tau**2: that raises OverflowError)
        for key, value, ok in (
            ("server_lr", server_lr, 0 < server_lr <= MAX_SERVER_LR),
            ("beta1", beta1, 0 <= beta1 < 1),
            ("beta2", beta2, 0 <= beta2 < 1),
            ("tau", tau, TAU_RANGE[0] <= tau <= TAU_RANGE[1]),
            ("initial_v", v0, v0 >= 0),
        ):
            if not ok:
                raise BadParameter(f"strategy {self.name!r}: {key}={value} is out of range")
        self.server_lr, self.beta1, self.beta2, self.tau = server_lr, beta1, beta2, tau
        self.bias_correction, self.initial_v = bias_correction, v0
        self._m: State = {}
        self._v: State = {}
        self._t = 0  # steps taken before this round's

    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._m, self._v = dict(state.get("m", {})), dict(state.get("v", {}))
        self._t = int(state.get("t", 0))

    def state_dict(self) -> dict[str, Any]:
        return {"m": self._m, "v": self._v, "t": self._t}

    def finish(self) -> State:
        stepped = self._n > 0  # a round with nothing folded takes no step
        out = super().finish()
        self._t += stepped
        return out

    def _lr(self) -> float:
        """η, or Adam's bias-corrected η at this round's step t = self._t + 1."""
        if not self.bias_correction:
            return self.server_lr
        t = self._t + 1
        return self.server_lr * (1 - self.beta2**t) ** 0.5 / (1 - self.beta1**t)

    def step(self, name: str, theta: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        m = (1 - self.beta1) * delta + (self.beta1 * self._m[name] if name in self._m else 0)
        v0 = self._v[name] if name in self._v else torch.full_like(delta, self.initial_v)
        v = self.second_moment(v0, delta * delta)
        self._m[name], self._v[name] = m, v
        return theta + self._lr() * m / (v.sqrt() + self.tau)


class FedAdagrad(FedOpt):
    name: ClassVar[str] = "fedadagrad"

    def __init__(
        self,
        server_lr: float = 1.0,
        beta1: float = 0.0,
        tau: float = 0.3,
        bias_correction: bool = False,
        initial_v: float | None = None,
        weighted: bool = True,
    ) -> None:
        super().__init__(
            server_lr=server_lr,
            beta1=beta1,
            tau=tau,
            bias_correction=bias_correction,
            initial_v=initial_v,
            weighted=weighted,
        )

    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        return v + d2


class FedAdam(FedOpt):
    name: ClassVar[str] = "fedadam"

    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        return self.beta2 * v + (1 - self.beta2) * d2


class FedYogi(FedOpt):
    name: ClassVar[str] = "fedyogi"

    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        return v - (1 - self.beta2) * d2 * torch.sign(v - d2)
