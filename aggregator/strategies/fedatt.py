"""FedAtt, attentive aggregation (Ji et al. 2019), folded one client at a time.

Per tensor l: s_k = ‖θ^l − θ_k^l‖ ('fro': Frobenius/vector 2-norm; 'spectral': largest singular value of a
2-D tensor, tensors with more dimensions reshaped to (shape[0], -1), 1-D and 0-D tensors use the vector
2-norm), α_k = softmax_k(s_k) over the positive distance, and

    θ^l ← θ^l − ε Σ_k α_k (θ^l − θ_k^l + β ξ_k),   ξ_k ~ N(0, σ²) elementwise (optional randomization),

which equals (1 − ε) θ^l + ε Σ_k α_k (θ_k^l − β ξ_k) (see :mod:`softmax_weighted`). For an update that
arrives as a delta, s_k = ‖Δ_k^l‖ reads the update once. The noise is drawn per client term from a
torch.Generator seeded with ``seed``, in fold order, so a seeded run is reproducible.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from aggregator.strategies._common import sq_distance, update_sq_norm
from aggregator.strategies.base import ClientUpdate
from aggregator.strategies.softmax_weighted import SoftmaxWeighted
from fedmq.checks import check_number
from fedmq.errors import BadParameter

NORMS = ("fro", "spectral")


def _spectral(diff: torch.Tensor) -> float:
    if diff.dim() > 2:
        diff = diff.reshape(diff.shape[0], -1)
    return float(torch.linalg.matrix_norm(diff, ord=2))


def tensor_distance(a: torch.Tensor, b: torch.Tensor, norm: str = "fro") -> float:
    """‖a − b‖ under the FedAtt norm (see module docstring)."""
    dtype = a.dtype if a.dtype in (torch.float32, torch.float64) else torch.float32
    a, b = a.to(dtype), b.to(dtype)
    if norm == "fro" or a.dim() < 2:
        return math.sqrt(sq_distance(a, b))
    return _spectral(a - b)


class FedAtt(SoftmaxWeighted):
    name: ClassVar[str] = "fedatt"

    @classmethod
    def from_config(cls, cfg: Any, **extra: Any) -> "FedAtt":
        return cls(epsilon=cfg.att_eps, norm=cfg.att_norm, **extra)

    def __init__(self, epsilon: float = 1.2, norm: str = "fro", beta: float = 0.0, sigma: float = 1.0, seed: int = 0) -> None:
        super().__init__()
        self.epsilon = self.step_size = check_number("epsilon", epsilon, low=0.0, low_open=True)
        if norm not in NORMS:
            raise BadParameter(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
        self.norm = norm
        self.beta = check_number("beta", beta, low=0.0)
        self.sigma = check_number("sigma", sigma, low=0.0)
        self.seed = int(check_number("seed", seed))
        self._gen = torch.Generator().manual_seed(self.seed)

    def score(self, name: str, update: ClientUpdate) -> float:
        t = update.tensors[name]
        if self.norm == "fro" or t.dim() < 2:
            return math.sqrt(update_sq_norm(update, self._global, name))  # type: ignore[arg-type]
        if update.delta:
            return _spectral(t.float())
        return tensor_distance(self._global[name], t, self.norm)  # type: ignore[index]

    def term(self, name: str, update: ClientUpdate) -> torch.Tensor:
        t = update.tensors[name]
        if self.beta > 0.0 and self.sigma > 0.0:
            noise = torch.randn(t.shape, generator=self._gen, dtype=torch.float32)
            return t.float() - noise.mul_(self.beta * self.sigma)
        return t
