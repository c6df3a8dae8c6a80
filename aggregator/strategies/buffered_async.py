"""Buffered asynchronous aggregation (FedBuff-style) with staleness weighting.

Contract with the engine (asynchronous mode, no rounds):

* ``begin(θ_v)`` with the current global model (version v); ``fold`` arrivals until ``ready`` (K =
  ``buffer_size`` updates folded); ``finish()`` → θ_{v+1}; ``begin`` again with it.
* ``update.staleness`` τ = global versions published since the client's base model.
  τ > ``max_staleness`` → ``fold`` raises :class:`StaleUpdate` and changes nothing (the engine acks, logs
  and counts the drop). τ < 0 is a StrategyError.
* The update is a *delta*. Preferred: ``update.extra["delta"]`` = Δ_k = θ_k − θ_{base_k} (a tensor per
  manifest name; the engine already has the base to resolve deltas, so it passes Δ_k along). Without it,
  Δ_k = θ_k − θ_v is computed from ``update.tensors``, which is exact only when τ = 0; a stale update with
  no delta is rejected with StrategyError.

Aggregation, with s(τ) = 1/sqrt(1 + τ) and n = Σ_k n_k over the buffer:

    θ_{v+1} = θ_v + η_g · Σ_k s(τ_k) n_k Δ_k / Σ_k n_k

The staleness factor is deliberately *not* renormalised (dividing by Σ s(τ_k) n_k instead would cancel it
whenever the buffer's updates share one staleness, e.g. K = 1): a buffer of stale updates moves the model
less. η_g (``server_lr``) defaults to 1.0, so K fresh updates give exactly FedAvg of their models.
"""

from __future__ import annotations

import math
from typing import ClassVar, Mapping

import torch

from aggregator.strategies._common import (
    cast_like,
    check_int,
    check_number,
    check_started,
    validate_update,
    zeros_like_state,
)
from aggregator.strategies.base import ClientUpdate, State, Strategy
from aggregator.strategies.errors import StaleUpdate, StrategyError


def staleness_weight(tau: int) -> float:
    return 1.0 / math.sqrt(1.0 + tau)


class BufferedAsync(Strategy):
    name: ClassVar[str] = "async"

    def __init__(self, buffer_size: int = 10, max_staleness: int = 10, server_lr: float = 1.0) -> None:
        self.buffer_size = check_int("buffer_size", buffer_size, low=1)
        self.max_staleness = check_int("max_staleness", max_staleness, low=0)
        self.server_lr = check_number("server_lr", server_lr, low=0.0, low_open=True)
        self._global: Mapping[str, torch.Tensor] | None = None
        self._acc: State = {}
        self._n = 0
        self._count = 0
        self._terms: dict[str, float] = {}
        self._last_weights: dict[str, float] = {}
        self.dropped = 0

    @property
    def ready(self) -> bool:
        """True once ``buffer_size`` updates were folded: the engine should call ``finish``."""
        return self._count >= self.buffer_size

    @property
    def pending(self) -> int:
        return self._count

    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        self._global = global_state
        self._acc = zeros_like_state(global_state)
        self._n = 0
        self._count = 0
        self._terms = {}

    def fold(self, update: ClientUpdate) -> None:
        g = check_started(self._global, self.name)
        tau = update.staleness
        if isinstance(tau, bool) or not isinstance(tau, int) or tau < 0:
            raise StrategyError(f"update from {update.client!r}: staleness must be an integer >= 0, got {tau!r}")
        if tau > self.max_staleness:
            self.dropped += 1
            raise StaleUpdate(tau, self.max_staleness, update.client)
        delta = update.extra.get("delta")
        if delta is None:
            if tau > 0:
                raise StrategyError(f"update from {update.client!r}: staleness {tau} needs extra['delta'] (θ_k − θ_base)")
            validate_update(update, g)
            terms = {name: (t, g[name]) for name, t in update.tensors.items()}
        else:
            as_update = ClientUpdate(update.client, update.n_samples, delta)
            validate_update(as_update, g)
            terms = {name: (d, None) for name, d in delta.items()}
        w = staleness_weight(tau) * update.n_samples
        for name, (t, base) in terms.items():
            self._acc[name].add_(t, alpha=w)
            if base is not None:
                self._acc[name].add_(base, alpha=-w)
        self._n += update.n_samples
        self._count += 1
        key = update.client
        while key in self._terms:
            key += "'"
        self._terms[key] = w

    def finish(self) -> State:
        g = check_started(self._global, self.name)
        if self._count == 0:
            out = {k: v.clone() for k, v in g.items()}
            self._last_weights = {}
        else:
            scale = self.server_lr / self._n
            out = cast_like({k: acc.mul_(scale).add_(g[k]) for k, acc in self._acc.items()}, g)
            self._last_weights = {c: w / self._n for c, w in self._terms.items()}
        self._global, self._acc, self._count = None, {}, 0
        return out

    def state_dict(self) -> dict:
        return {"dropped": self.dropped}

    def load_state_dict(self, state: dict) -> None:
        self.dropped = int(state.get("dropped", 0))
