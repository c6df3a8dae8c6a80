"""Dynamic-pulled aggregation (Passban et al. 2022): per-tensor FedAvg over the clients that sent it.

Each client sends only the tensors its pulling rule selected (fedmq.pulling.select_tensors). For
tensor t: θ_t ← Σ_{k sent t} n_k θ_{k,t} / Σ_{k sent t} n_k; a tensor nobody sent keeps the server's value.
pull-local, pull-global and pull-random aggregate alike;
they differ in the rule their ``plan`` gives the agents.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from fedmq.aggregator.strategies._common import (
    WeightedSum,
    cast_like,
    check_started,
    validate_update,
    zeros_like_state,
)
from fedmq.aggregator.strategies.base import ClientUpdate, RoundPlan, State, Strategy


class DynamicPull(Strategy):
    name: ClassVar[str] = "dynamic-pull"

    def __init__(self) -> None:
        self._global: Mapping[str, torch.Tensor] | None = None
        self._sums: dict[str, WeightedSum] = {}  # per tensor: Σ n_k θ_k over the clients that sent it
        self._share: dict[str, dict[str, float]] = {}  # client -> tensor -> n_k (for client_weights)
        self._last_weights: dict[str, float] = {}
        self.last_samples_per_tensor: dict[str, int] = {}

    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        self._global = global_state
        self._sums = {}
        self._share = {}

    def fold(self, update: ClientUpdate) -> None:
        g = check_started(self._global, self.name)
        validate_update(update, g, subset=True)
        for name, t in update.tensors.items():
            acc = self._sums.get(name)
            if acc is None:  # allocated lazily: tensors nobody sends cost nothing
                acc = self._sums[name] = WeightedSum(zeros_like_state({name: g[name]})[name])
            acc.add(update.n_samples, t, update.delta)
        key = update.client
        while key in self._share:
            key += "'"
        self._share[key] = {name: float(update.n_samples) for name in update.tensors}

    def finish(self) -> State:
        g = check_started(self._global, self.name)
        n = {name: int(s.w) for name, s in self._sums.items()}
        out: State = {}
        for name, ref in g.items():
            s = self._sums.get(name)
            out[name] = s.combine(ref, 1.0 / s.w) if s is not None else ref.clone()
        out = cast_like(out, g)
        # mean over all tensors of the client's share of each tensor (0 for tensors it did not send)
        self._last_weights = (
            {c: sum(k / n[name] for name, k in sent.items()) / len(g) for c, sent in self._share.items()}
            if g
            else {}
        )
        self.last_samples_per_tensor = n
        self._global, self._sums = None, {}
        return out


class PullLocal(DynamicPull):
    """DP_l: agents send their slowest-moving tensors."""

    name: ClassVar[str] = "pull-local"
    plan: ClassVar[RoundPlan] = RoundPlan(pull="local")


class PullGlobal(DynamicPull):
    """DP_g: agents send their fastest-moving tensors."""

    name: ClassVar[str] = "pull-global"
    plan: ClassVar[RoundPlan] = RoundPlan(pull="global")


class PullRandom(DynamicPull):
    """Agents send random tensors holding as many parameters as DP_g's."""

    name: ClassVar[str] = "pull-random"
    plan: ClassVar[RoundPlan] = RoundPlan(pull="random")
