"""Helpers the strategies share: update validation, accumulator allocation and a running log-sum-exp."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from fedmq.aggregator.strategies.base import ClientUpdate, State
from fedmq.errors import StrategyError
from fedmq.state_checks import all_finite

# Bounds of parameters a constructor can check: finite values beyond them make every update non-finite
# (skipped) or a round that never fills, so a job would only wait on its deadlines.
MAX_SERVER_LR = 100.0  # fedopt, fedavgm, scaffold, async
MAX_MU = 100.0  # fedprox's proximal weight
TAU_RANGE = (1e-12, 1e3)  # fedopt's adaptivity: tau**2 is its first v, and it divides every step
MAX_STEP_SIZE = 100.0  # fedatt's epsilon
MAX_BUFFER = 100_000  # async's buffer_size: updates per aggregation


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulate in the tensor's own float dtype, but never below float32 (half sums lose too much)."""
    if t.dtype in (torch.float32, torch.float64):
        return t.dtype
    return torch.float32


def zeros_like_state(state: Mapping[str, torch.Tensor]) -> State:
    return {k: torch.zeros(v.shape, dtype=acc_dtype(v)) for k, v in state.items()}


def cast_like(result: State, reference: Mapping[str, torch.Tensor]) -> State:
    return {k: (v if v.dtype == reference[k].dtype else v.to(reference[k].dtype)) for k, v in result.items()}


def check_started(global_state: Mapping[str, torch.Tensor] | None, name: str) -> Mapping[str, torch.Tensor]:
    if global_state is None:
        raise StrategyError(f"{name}: fold/finish called before begin()")
    return global_state


def validate_update(
    update: ClientUpdate,
    global_state: Mapping[str, torch.Tensor],
    *,
    subset: bool = False,
    need_samples: bool = True,
    check_finite: bool = True,
) -> None:
    """Raise StrategyError unless every tensor is known, shaped like the global one and finite.

    ``subset`` allows a client to send only some tensors (dynamic pulling); otherwise all are required.
    Runs before anything is folded, so a rejected update changes nothing. Strategies that compute a score
    over every tensor anyway (FedAtt, FedMed) pass ``check_finite=False`` and call :func:`check_score`,
    saving one pass over the update (a NaN/inf element makes the score non-finite).
    """
    if need_samples and (
        not isinstance(update.n_samples, int) or isinstance(update.n_samples, bool) or update.n_samples <= 0
    ):
        raise StrategyError(
            f"update from {update.client!r}: n_samples must be a positive integer, got {update.n_samples!r}"
        )
    names = set(update.tensors)
    unknown = names - set(global_state)
    if unknown:
        raise StrategyError(f"update from {update.client!r}: unknown tensor {sorted(unknown)[0]!r}")
    if not subset:
        missing = set(global_state) - names
        if missing:
            raise StrategyError(f"update from {update.client!r}: missing tensor {sorted(missing)[0]!r}")
    elif not names:
        raise StrategyError(f"update from {update.client!r}: no tensors")
    for name, t in update.tensors.items():
        if not isinstance(t, torch.Tensor):
            raise StrategyError(f"update from {update.client!r}: tensor {name!r} is not a torch.Tensor")
        if tuple(t.shape) != tuple(global_state[name].shape):
            raise StrategyError(
                f"update from {update.client!r}: tensor {name!r} has shape {tuple(t.shape)}, "
                f"expected {tuple(global_state[name].shape)}"
            )
        if check_finite and t.is_floating_point() and not all_finite(t):
            raise StrategyError(f"update from {update.client!r}: tensor {name!r} has non-finite values")


def check_score(update: ClientUpdate, name: str, score: float) -> None:
    """Reject the update when a per-tensor score is not finite (its tensor holds NaN/inf)."""
    if not math.isfinite(score):
        raise StrategyError(f"update from {update.client!r}: tensor {name!r} has non-finite values")


_CHUNK = 1 << 18


def sq_distance(a: torch.Tensor, b: torch.Tensor, tmp: torch.Tensor | None = None) -> float:
    """‖a − b‖² in cache-sized chunks (sub into a small scratch buffer + dot): about 7× faster than
    torch.dist on large tensors single-threaded, and no tensor-sized temporary. Partial sums in float64."""
    x, y = a.reshape(-1), b.reshape(-1)
    if x.dtype != y.dtype:
        y = y.to(x.dtype)
    n = x.numel()
    if n <= _CHUNK:
        d = x - y
        return float(torch.dot(d, d))
    if tmp is None or tmp.dtype != x.dtype or tmp.numel() < _CHUNK:
        tmp = torch.empty(_CHUNK, dtype=x.dtype)
    total = 0.0
    for i in range(0, n, _CHUNK):
        m = min(_CHUNK, n - i)
        d = torch.sub(x[i : i + m], y[i : i + m], out=tmp[:m])
        total += float(torch.dot(d, d))
    return total


def check_sums(sums: Mapping[str, torch.Tensor], model: Mapping[str, torch.Tensor], what: str) -> None:
    """StrategyError unless every tensor of ``sums`` (a partial or secure sum) is one of ``model``'s, shaped
    like it and finite: checked whole, before anything is added."""
    for name, acc in sums.items():
        if name not in model or tuple(acc.shape) != tuple(model[name].shape):
            raise StrategyError(f"{what}: tensor {name!r} is not one of the model's, or misshaped")
        if not all_finite(acc):
            raise StrategyError(f"{what}: tensor {name!r} is not finite")


def full_tensor(update: ClientUpdate, global_state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """θ_k of one tensor whichever form the update came in (a new tensor for a delta update)."""
    t = update.tensors[name]
    return global_state[name] + t if update.delta else t


def update_sq_norm(update: ClientUpdate, global_state: Mapping[str, torch.Tensor], name: str) -> float:
    """‖θ_k − θ‖² of one tensor: a plain dot for a delta update (one read), else :func:`sq_distance`."""
    t = update.tensors[name]
    if update.delta:
        x = t.detach().reshape(-1).to(acc_dtype(t)).cpu().contiguous().numpy()
        return float(np.dot(x, x))  # numpy's BLAS dot: ~25 % faster than torch.dot here, single-threaded
    g = global_state[name]
    return sq_distance(t.to(acc_dtype(g)), g.to(acc_dtype(g)))


class WeightedSum:
    """Σ_k w_k θ_k for updates given either as θ_k or as Δ_k = θ_k − θ, in one buffer.

    A delta term adds w_k Δ_k to ``acc`` and w_k to the scalar ``w_base``, so that Σ w_k θ_k =
    acc + w_base·θ: folding a delta costs one pass, like folding a full tensor, and θ is added once at the
    end. ``w`` is Σ w_k.
    """

    __slots__ = ("acc", "w", "w_base")

    def __init__(self, acc: torch.Tensor) -> None:
        self.acc = acc  # zero-filled buffer
        self.w = 0.0
        self.w_base = 0.0

    def add(self, w: float, x: torch.Tensor, delta: bool) -> None:
        self.acc.add_(x, alpha=w)
        self.w += w
        if delta:
            self.w_base += w

    def combine(self, base: torch.Tensor, scale: float, base_coef: float = 0.0) -> torch.Tensor:
        """scale·Σ_k w_k θ_k + base_coef·θ, in place (the buffer is consumed)."""
        coef = scale * self.w_base + base_coef
        if math.isclose(coef, 1.0, rel_tol=1e-12):  # all deltas, the engine's case: θ + scale·acc in one pass
            return torch.add(base, self.acc, alpha=scale, out=self.acc)
        out = self.acc.mul_(scale)
        return out.add_(base, alpha=coef) if coef != 0.0 else out


class RunningSoftmaxSum(WeightedSum):
    """Σ_k softmax_k(s)·θ_k folded one (s_k, x_k) at a time with a running log-sum-exp.

    Keeps a reference score m and weights w_k = e^{s_k − m} (``w`` = their sum z). The first score sets m;
    only a score above m + ``MARGIN`` moves it, rescaling the accumulator and both weight sums by
    e^{m_old − m_new} (< 1). So weights stay ≤ e^MARGIN (no float32 overflow) while the usual new maximum
    costs no extra pass over the buffer. One buffer the size of x; x_k is θ_k or Δ_k as in
    :class:`WeightedSum`.
    """

    MARGIN = 20.0

    __slots__ = ("m",)

    def __init__(self, acc: torch.Tensor) -> None:
        super().__init__(acc)
        self.m = -math.inf

    def add_scored(self, s: float, x: torch.Tensor, delta: bool) -> None:
        if s > self.m + self.MARGIN or self.m == -math.inf:
            if self.w > 0.0:
                scale = math.exp(self.m - s)
                self.acc.mul_(scale)
                self.w *= scale
                self.w_base *= scale
            self.m = s
        self.add(math.exp(s - self.m), x, delta)

    def step(self, base: torch.Tensor, eps: float) -> torch.Tensor:
        """(1 − ε)·θ + ε·Σ_k softmax_k(s)·θ_k, in place (the buffer is consumed)."""
        return self.combine(base, eps / self.w, 1.0 - eps)
