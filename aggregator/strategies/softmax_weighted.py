"""The streaming core FedAtt and FedMed share: per tensor, a softmax over per-client scores, then a step.

Per tensor l, with a score s_k^l per client (FedAtt: a distance, FedMed: a JS divergence):

    θ^l ← (1 − ε) θ^l + ε Σ_k softmax_k(s_k^l) x_k^l

where x_k is the client's tensor θ_k. Each Σ is a
:class:`RunningSoftmaxSum` (a running log-sum-exp, one model-sized buffer), and an update folded as a
delta Δ_k = θ_k − θ costs one pass like a full one (see :class:`WeightedSum`).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Mapping

import torch

from fedmq.aggregator.strategies._common import (
    RunningSoftmaxSum,
    cast_like,
    check_score,
    check_started,
    validate_update,
    zeros_like_state,
)
from fedmq.aggregator.strategies.base import ClientUpdate, State, Strategy


def softmax_dict(scores: dict[str, float]) -> dict[str, float]:
    m = max(scores.values())
    e = {k: math.exp(v - m) for k, v in scores.items()}
    z = sum(e.values())
    return {k: v / z for k, v in e.items()}


class SoftmaxWeighted(Strategy):
    """``begin``/``fold``/``finish`` for score-softmax aggregation; subclasses give ``score`` and the step."""

    step_size: float = 1.0

    def __init__(self) -> None:
        self._global: Mapping[str, torch.Tensor] | None = None
        self._sums: dict[str, RunningSoftmaxSum] = {}
        self._scores: dict[str, dict[str, float]] = {}  # client -> tensor -> s_k (a few floats per client)
        self._last_weights: dict[str, float] = {}

    @abstractmethod
    def score(self, name: str, update: ClientUpdate) -> float:
        """s_k of one tensor of ``update`` against the global model (``self._global``)."""

    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        self._global = global_state
        self._sums = {k: RunningSoftmaxSum(v) for k, v in zeros_like_state(global_state).items()}
        self._scores = {}

    def fold(self, update: ClientUpdate) -> None:
        scores = self.score_only(update)
        for name in update.tensors:
            self._sums[name].add_scored(scores[name], update.tensors[name], update.delta)

    def score_only(self, update: ClientUpdate) -> dict[str, float]:
        """Validate and score ``update`` and record its scores, without adding it to the weighted sums."""
        g = check_started(self._global, self.name)
        validate_update(update, g, need_samples=False, check_finite=False)
        scores = {name: self.score(name, update) for name in update.tensors}
        for name, s in scores.items():
            check_score(update, name, s)  # a NaN/inf element makes its score non-finite: nothing folded yet
        key = update.client
        while key in self._scores:  # the same client twice in one round stays two terms
            key += "'"
        self._scores[key] = scores
        return scores

    def finish(self) -> State:
        g = check_started(self._global, self.name)
        if not self._scores:
            out = {k: v.clone() for k, v in g.items()}
        else:
            out = cast_like({name: s.step(g[name], self.step_size) for name, s in self._sums.items()}, g)
        self._last_weights = self._mean_alpha()
        self._global, self._sums = None, {}
        return out

    def _mean_alpha(self) -> dict[str, float]:
        """Each client's softmax weight, averaged over tensors (for metrics and plots)."""
        if not self._scores:
            return {}
        tensors = next(iter(self._scores.values())).keys()
        total = {c: 0.0 for c in self._scores}
        for name in tensors:
            for c, a in softmax_dict({c: sc[name] for c, sc in self._scores.items()}).items():
                total[c] += a
        return {c: v / len(tensors) for c, v in total.items()}
