"""Buffered asynchronous aggregation (FedBuff-style) with staleness weighting.

Contract with the engine (asynchronous mode, no rounds):

* ``begin(θ_v)`` with the current global model (version v); ``fold`` arrivals until the engine has K (=
  ``buffer_size``) or its deadline passed; ``finish()`` → θ_{v+1}; ``begin`` again with it. The engine
  reads ``buffer_size`` and ``max_staleness`` from the strategy (a strategy of its own in asynchronous mode
  has both attributes, as this one's subclasses do).
* ``update.staleness`` τ = global versions published since the client's base model.
  τ > ``max_staleness`` → ``fold`` raises :class:`StaleUpdate` and changes nothing (the engine acks, logs
  and counts the drop). τ < 0 is a StrategyError.
* A stale update (τ > 0) must come as a delta (``update.delta``): Δ_k = θ_k − θ_{base_k}, against the model
  the client started from, which the engine decodes it against. A full θ_k is only meaningful when τ = 0
  (Δ_k = θ_k − θ_v); a stale full update is rejected with StrategyError.

Aggregation, with s(τ) = 1/sqrt(1 + τ) and n = Σ_k n_k over the buffer:

    θ_{v+1} = θ_v + η_g · Σ_k s(τ_k) n_k Δ_k / Σ_k n_k

The staleness factor is deliberately *not* renormalised (dividing by Σ s(τ_k) n_k instead would cancel it
whenever the buffer's updates share one staleness, e.g. K = 1): a buffer of stale updates moves the model
less. η_g (``server_lr``) defaults to 1.0, so K fresh updates give exactly FedAvg of their models. This is
FedAvg's streaming fold with the client weight w_k = η_g s(τ_k) n_k.

Under secure aggregation (a secure buffer: aggregator.secure_buffers) the aggregator sees only the buffer's
sum: each client weighs its own change by s(τ_k) (it knows its version) and n_k, and ``fold_partial`` takes
the sum Σ s(τ_k) n_k Δ_k with Σ n_k and applies η_g, so a secure buffer gives the formula above.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from fedmq.aggregator.strategies._common import MAX_BUFFER, MAX_SERVER_LR
from fedmq.aggregator.strategies.base import ClientUpdate, PartialSum, RoundPlan, State, Strategy
from fedmq.aggregator.strategies.errors import StaleUpdate
from fedmq.aggregator.strategies.fedavg import FedAvg
from fedmq.checks import check_int, check_number
from fedmq.errors import StrategyError
from fedmq.staleness import staleness_weight


class BufferedAsync(FedAvg):
    name: ClassVar[str] = "async"
    plan: ClassVar[RoundPlan] = RoundPlan(mode="async")
    secure_sum: ClassVar[bool] = True  # the clients apply s(τ) (module docstring)

    # buffer_size 5 (was 3): with the default 8 clients, 3 a version left most updates stale and the model
    # rose at version 2 (docs/guide/strategy.md "Defaults, as swept"); a job of fewer clients than that
    # waits for all of them (from_config)
    def __init__(self, buffer_size: int = 5, max_staleness: int = 5, server_lr: float = 1.0) -> None:
        super().__init__()
        self.buffer_size = check_int("buffer_size", buffer_size, low=1, high=MAX_BUFFER)
        self.max_staleness = check_int("max_staleness", max_staleness, low=0)
        self.server_lr = check_number("server_lr", server_lr, low=0.0, low_open=True, high=MAX_SERVER_LR)
        self._count = 0
        self.dropped = 0

    @classmethod
    def from_config(cls, cfg: Any, **extra: Any) -> Strategy:
        """The default buffer never waits for more arrivals than the job has clients (a version would
        otherwise always close at its deadline); a buffer_size the job gives is kept as it is."""
        strategy = super().from_config(cfg, **extra)
        if "buffer_size" not in {**cfg.strategy_args, **extra}:
            strategy.buffer_size = min(strategy.buffer_size, cfg.clients)  # type: ignore[attr-defined]
        return strategy

    @property
    def pending(self) -> int:
        return self._count

    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        super().begin(global_state)
        self._count = 0

    def weight(self, update: ClientUpdate) -> float:
        return self.server_lr * staleness_weight(update.staleness) * update.n_samples

    def fold(self, update: ClientUpdate) -> None:
        self.admit(update)
        super().fold(update)
        self._count += 1

    def fold_partial(self, part: PartialSum) -> None:
        """A secure buffer's sum, its changes weighed by s(τ_k) n_k on the clients: η_g is applied here."""
        lr = self.server_lr
        super().fold_partial(dataclasses.replace(part, sums={k: t * lr for k, t in part.sums.items()}))
        self._count += len(part.terms)

    def admit(self, update: ClientUpdate) -> None:
        """Raise unless ``update`` may be folded: its staleness an integer within ``max_staleness``, and a
        stale update a delta (the module docstring); the DP wrapper asks it too."""
        tau = update.staleness
        if isinstance(tau, bool) or not isinstance(tau, int) or tau < 0:
            raise StrategyError(
                f"update from {update.client!r}: staleness must be an integer >= 0, got {tau!r}"
            )
        if tau > self.max_staleness:
            self.dropped += 1
            raise StaleUpdate(tau, self.max_staleness, update.client)
        if tau > 0 and not update.delta:
            raise StrategyError(
                f"update from {update.client!r}: staleness {tau} needs a delta update (θ_k − θ_base)"
            )

    def finish(self) -> State:
        self._count = 0
        return super().finish()
