"""FedAvg (θ = Σ n_k/n · θ_k) and FedSGD (the same average; the round config asks for one local pass).

FedSGD aggregates exactly like FedAvg; what makes it FedSGD is its round (every client selected, one step on
the gradient of the whole shard: McMahan et al.'s B = ∞, E = 1),
which its ``plan`` and ``configure_train`` set.

:class:`FedAvg` is also the streaming core of the strategies that only change a client's weight
(clipping, staleness): with w_k = ``weight(update)`` and n = Σ n_k,

    θ ← θ + Σ_k w_k (θ_k − θ) / n = Σ_k w_k θ_k / n + (1 − Σ_k w_k / n) θ,

which is plain FedAvg when w_k = n_k.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import ClassVar

import torch

from fedmq.aggregator.strategies._common import (
    WeightedSum,
    cast_like,
    check_started,
    check_sums,
    validate_update,
    zeros_like_state,
)
from fedmq.aggregator.strategies.base import ClientUpdate, PartialSum, RoundPlan, State, Strategy
from fedmq.errors import StrategyError
from fedmq.train_config import TrainConfig


class FedAvg(Strategy):
    """Running n_k-weighted sum: one accumulator the size of the model, whatever the number of clients."""

    name: ClassVar[str] = "fedavg"
    partial_sums: ClassVar[bool] = True
    secure_sum: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: object) -> None:
        """A subclass that folds otherwise, or folds the round twice (second_pass), has no partial sums
        unless it says so itself (base.Strategy.partial_sums); one that also weighs otherwise, no secure sums
        (base.Strategy.secure_sum)."""
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        if ("fold" in own or "second_pass" in own) and "partial_sums" not in own:
            cls.partial_sums = False
        if any(m in own for m in ("fold", "second_pass", "weight", "count")) and "secure_sum" not in own:
            cls.secure_sum = False

    def __init__(self) -> None:
        self._global: Mapping[str, torch.Tensor] | None = None
        self._sums: dict[str, WeightedSum] = {}
        self._n: float = 0
        self._terms: dict[str, float] = {}  # client -> Σ w_k, for client_weights
        self._last_weights: dict[str, float] = {}

    def weight(self, update: ClientUpdate) -> float:
        """w_k of a validated update (n_k here; subclasses scale it)."""
        return float(update.n_samples)

    def count(self, update: ClientUpdate) -> float:
        """What an update adds to the denominator n (n_k: the mean is over samples)."""
        return update.n_samples

    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        self._global = global_state
        self._sums = {k: WeightedSum(v) for k, v in zeros_like_state(global_state).items()}
        self._n = 0
        self._terms = {}

    def fold(self, update: ClientUpdate) -> None:
        g = check_started(self._global, self.name)
        validate_update(update, g)
        w = self.weight(update)
        for name, t in update.tensors.items():
            self._sums[name].add(w, t, update.delta)
        self._n += self.count(update)
        self._terms[update.client] = self._terms.get(update.client, 0.0) + w

    def partial(self) -> PartialSum:
        if not self.partial_sums:  # a subclass that folds otherwise (base.Strategy.partial_sums)
            return super().partial()
        check_started(self._global, self.name)
        sums, self._sums = self._sums, {}
        return PartialSum(
            {k: s.acc for k, s in sums.items()},
            {k: (s.w, s.w_base) for k, s in sums.items()},
            self._n,
            dict(self._terms),
        )

    def fold_partial(self, part: PartialSum) -> None:
        if not (self.partial_sums or self.secure_sum):  # an edge's partial, or a secure round's sum
            return super().fold_partial(part)
        check_sums(part.sums, check_started(self._global, self.name), "partial sum")
        numbers = [part.count, *part.terms.values(), *(x for w in part.weights.values() for x in w)]
        if set(part.weights) != set(part.sums) or not all(math.isfinite(x) and x >= 0 for x in numbers):
            raise StrategyError("partial sum: weights missing, negative or not finite")
        twice = sorted(set(part.terms) & set(self._terms))
        if twice:
            raise StrategyError(f"partial sum: client {twice[0]!r} folded twice")
        for name, acc in part.sums.items():
            s = self._sums[name]
            s.acc.add_(acc.to(s.acc.dtype))
            s.w += part.weights[name][0]
            s.w_base += part.weights[name][1]
        self._n += part.count
        self._terms.update(part.terms)

    def finish(self) -> State:
        g = check_started(self._global, self.name)
        if self._n == 0:
            out = {k: v.clone() for k, v in g.items()}
        else:
            out = cast_like(
                {k: s.combine(g[k], 1.0 / self._n, 1.0 - s.w / self._n) for k, s in self._sums.items()}, g
            )
        self._last_weights = {c: w / self._n for c, w in self._terms.items()} if self._n else {}
        self._global, self._sums = None, {}
        return out


class FedSGD(FedAvg):
    """FedAvg's aggregation under FedSGD's name (its round: see the module docstring)."""

    name: ClassVar[str] = "fedsgd"
    plan: ClassVar[RoundPlan] = RoundPlan(select_all=True)

    @classmethod
    def configure_train(cls, train: TrainConfig) -> TrainConfig:
        return dataclasses.replace(train, epochs=1, full_batch=True, max_steps=0)


class ServerStep(FedAvg):
    """FedAvg's mean change Δ_t = θ̄_t − θ_t taken as a pseudo-gradient for a server optimizer's step
    (FedAvgM, FedAdam …): ``step`` returns θ_{t+1} for one tensor; nothing is folded, nothing moves.

    ``weighted`` (default) takes the n_k-weighted mean of the clients' changes, as FedAvg and Flower do;
    ``weighted=False`` the plain mean over the round's clients, as Reddi et al.'s Algorithm 2 writes it."""

    secure_sum: ClassVar[bool] = True

    def __init__(self, weighted: bool = True) -> None:
        super().__init__()
        self.weighted = weighted

    @property
    def weighs_samples(self) -> bool:
        return self.weighted

    def weight(self, update: ClientUpdate) -> float:
        return super().weight(update) if self.weighted else 1.0

    def count(self, update: ClientUpdate) -> float:
        return super().count(update) if self.weighted else 1

    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        super().begin(global_state)
        self._base = global_state

    def step(self, name: str, theta: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def finish(self) -> State:
        base, folded = self._base, self._n > 0
        average = super().finish()
        if not folded:
            return average
        return {k: self.step(k, theta, average[k] - theta) for k, theta in base.items()}
