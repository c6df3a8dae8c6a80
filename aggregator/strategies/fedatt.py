"""FedAtt, attentive aggregation (Ji et al. 2019), folded one client at a time.

Per tensor l: s_k = ‖θ^l − θ_k^l‖ ('fro': Frobenius/vector 2-norm; 'spectral': largest singular value of a
2-D tensor, tensors with more dimensions reshaped to (shape[0], -1), 1-D and 0-D tensors use the vector
2-norm), α_k = softmax_k(s_k) over the positive distance, and

    θ^l ← θ^l − ε Σ_k α_k (θ^l − θ_k^l) = (1 − ε) θ^l + ε Σ_k α_k θ_k^l

(see :mod:`softmax_weighted`). For an update that arrives as a delta, s_k = ‖Δ_k^l‖ reads the update once.

The paper's randomization (its Eq. 6, β ξ_k with ξ_k ~ N(0, σ²)) is "added in before the clients send the
updated parameters to the server, but it is written in the form of server optimization for simplicity": here
it is the clients' (``JobConfig.noise``, added in client_agent.agent before an update is encoded),
for every strategy. It states no ε: nothing bounds an update's norm and nothing accounts the noise, so it is
no differential privacy (that is ``dp``: docs/guide/privacy.md), and FedAtt refuses ``dp`` (its attention
weights depend on each client's model).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from fedmq.aggregator.strategies._common import MAX_STEP_SIZE, sq_distance, update_sq_norm
from fedmq.aggregator.strategies.base import ClientUpdate
from fedmq.aggregator.strategies.softmax_weighted import SoftmaxWeighted
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
    """Parameters: ``epsilon`` ε, the step size (``--eps``; 1.2), ``norm`` (``--norm``; fro or spectral)."""

    name: ClassVar[str] = "fedatt"

    def __init__(self, epsilon: float = 1.2, norm: str = "fro") -> None:
        super().__init__()
        # named with their flags too: --eps and --norm set them
        self.epsilon = self.step_size = check_number(
            "epsilon (--eps)", epsilon, low=0.0, low_open=True, high=MAX_STEP_SIZE
        )
        if norm not in NORMS:
            raise BadParameter(f"norm (--norm) must be one of {', '.join(NORMS)}, got {norm!r}")
        self.norm = norm

    def score(self, name: str, update: ClientUpdate) -> float:
        t = update.tensors[name]
        if self.norm == "fro" or t.dim() < 2:
            return math.sqrt(update_sq_norm(update, self._global, name))  # type: ignore[arg-type]
        if update.delta:
            return _spectral(t.float())
        return tensor_distance(self._global[name], t, self.norm)  # type: ignore[index]
