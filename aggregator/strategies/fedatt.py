"""FedAtt, attentive aggregation (Ji et al. 2019), folded one client at a time.

Per tensor l: s_k = ‖θ^l − θ_k^l‖ ('fro': Frobenius/vector 2-norm; 'spectral': largest singular value of a
2-D tensor, tensors with more dimensions reshaped to (shape[0], -1), 1-D and 0-D tensors use the vector
2-norm), α_k = softmax_k(s_k) over the positive distance, and

    θ^l ← θ^l − ε Σ_k α_k (θ^l − θ_k^l + β ξ_k),   ξ_k ~ N(0, σ²) elementwise (optional randomization),

which equals (1 − ε) θ^l + ε Σ_k α_k (θ_k^l − β ξ_k). The softmax-weighted sum is kept with a running
log-sum-exp per tensor (one model-sized buffer). The noise is drawn per client term from a torch.Generator
seeded with ``seed``, in fold order, so a seeded run is reproducible.
"""

from __future__ import annotations

import math
from typing import ClassVar, Mapping

import torch

from aggregator.strategies._common import (
    RunningSoftmaxSum,
    cast_like,
    check_score,
    check_number,
    check_started,
    sq_distance,
    validate_update,
    zeros_like_state,
)
from aggregator.strategies.base import ClientUpdate, State, Strategy
from aggregator.strategies.errors import BadParameter

NORMS = ("fro", "spectral")


def tensor_distance(a: torch.Tensor, b: torch.Tensor, norm: str = "fro") -> float:
    """‖a − b‖ under the FedAtt norm (see module docstring)."""
    dtype = a.dtype if a.dtype in (torch.float32, torch.float64) else torch.float32
    a, b = a.to(dtype), b.to(dtype)
    if norm == "fro" or a.dim() < 2:
        return math.sqrt(sq_distance(a, b))
    diff = a - b
    if diff.dim() > 2:
        diff = diff.reshape(diff.shape[0], -1)
    return float(torch.linalg.matrix_norm(diff, ord=2))


def softmax_dict(scores: dict[str, float]) -> dict[str, float]:
    m = max(scores.values())
    e = {k: math.exp(v - m) for k, v in scores.items()}
    z = sum(e.values())
    return {k: v / z for k, v in e.items()}


class FedAtt(Strategy):
    name: ClassVar[str] = "fedatt"

    def __init__(self, epsilon: float = 1.2, norm: str = "fro", beta: float = 0.0, sigma: float = 1.0, seed: int = 0) -> None:
        self.epsilon = check_number("epsilon", epsilon, low=0.0, low_open=True)
        if norm not in NORMS:
            raise BadParameter(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
        self.norm = norm
        self.beta = check_number("beta", beta, low=0.0)
        self.sigma = check_number("sigma", sigma, low=0.0)
        self.seed = int(check_number("seed", seed))
        self._gen = torch.Generator().manual_seed(self.seed)
        self._global: Mapping[str, torch.Tensor] | None = None
        self._sums: dict[str, RunningSoftmaxSum] = {}
        self._scores: dict[str, dict[str, float]] = {}  # client -> tensor -> s_k (a few floats per client)
        self._last_weights: dict[str, float] = {}

    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        self._global = global_state
        self._sums = {k: RunningSoftmaxSum(v) for k, v in zeros_like_state(global_state).items()}
        self._scores = {}

    def _score(self, name: str, theta_k: torch.Tensor) -> float:
        return tensor_distance(self._global[name], theta_k, self.norm)  # type: ignore[index]

    def fold(self, update: ClientUpdate) -> None:
        g = check_started(self._global, self.name)
        validate_update(update, g, need_samples=False, check_finite=False)
        scores = {name: self._score(name, t) for name, t in update.tensors.items()}
        for name, s in scores.items():
            check_score(update, name, s)
        for name, t in update.tensors.items():
            x = t
            if self.beta > 0.0 and self.sigma > 0.0:
                noise = torch.randn(t.shape, generator=self._gen, dtype=torch.float32)
                x = t.float() - noise.mul_(self.beta * self.sigma)
            self._sums[name].add(scores[name], x)
        key = update.client
        while key in self._scores:  # the same client twice in one round stays two terms
            key += "'"
        self._scores[key] = scores

    def finish(self) -> State:
        g = check_started(self._global, self.name)
        if not self._scores:
            out = {k: v.clone() for k, v in g.items()}
        else:
            out = {}
            for name, s in self._sums.items():
                mean = s.mean()  # Σ α_k x_k, in place
                out[name] = mean.mul_(self.epsilon).add_(g[name], alpha=1.0 - self.epsilon)
            out = cast_like(out, g)
        self._last_weights = self._mean_alpha()
        self._global, self._sums = None, {}
        return out

    def _mean_alpha(self) -> dict[str, float]:
        if not self._scores:
            return {}
        tensors = next(iter(self._scores.values())).keys()
        total = {c: 0.0 for c in self._scores}
        for name in tensors:
            for c, a in softmax_dict({c: sc[name] for c, sc in self._scores.items()}).items():
                total[c] += a
        return {c: v / len(tensors) for c, v in total.items()}

    def state_dict(self) -> dict:
        return {"generator": self._gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if "generator" in state:
            self._gen.set_state(state["generator"])
