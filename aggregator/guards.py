"""Bounds on one client's influence over a synchronous round, and the never-non-finite rule.

An authenticated agent can send finite but huge weights (3e38) with a huge ``n_samples`` (2**52): the NaN/Inf
checks pass, the weighted sum overflows and the global model becomes Inf/NaN. Or it sends all zeros with the
same ``n_samples`` and wipes the model. The engine therefore

* notes, for every folded update, its ``n_samples`` and the L2 norm of its delta ‖Δ_k‖
  (:meth:`RoundGuard.note`, one read of the update; float64 where float32 would overflow);
* at the close asks :meth:`RoundGuard.verdict` for the updates out of bounds, judged against the round's own
  lower median (with K updates, the ⌈K/2⌉-th smallest: with K ≥ 3 one hostile client cannot move it, and with
  K = 2 it is the smaller of the two):

  - ‖Δ_k‖ > ``norm_factor`` × median ‖Δ‖: the update is **dropped** (not clipped: with its weight still up to
    ``samples_factor`` × the median, a clipped −θ would still shrink the model by several honest steps);
  - n_k > ``samples_factor`` × median n: its weight is **capped** to that bound;

* and when something is out of bounds, aggregates the round again from its spool without / with the capped
  weights (a second pass only then: an honest round is folded once and its maths is unchanged).

Whatever the bounds, an aggregate with a NaN/Inf is never published or checkpointed (:func:`first_nonfinite`):
the round closes without an update. Needing the whole round (a median) is why the verdict waits for the close:
the engine folds updates as they stream in and keeps no copy, only their spooled bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from fedmq.aggregator.strategies.base import ClientUpdate


def delta_norm(update: ClientUpdate, global_state: Mapping[str, torch.Tensor]) -> float:
    """‖Δ_k‖ over all the update's tensors; float32 dots, redone in float64 if one overflows (3e38² does)."""
    total = 0.0
    for name, t in update.tensors.items():
        d = t.detach().float() if update.delta else t.detach().float() - global_state[name].float()
        x = d.reshape(-1).cpu().contiguous().numpy()
        with np.errstate(over="ignore"):
            sq = float(np.dot(x, x))
        if not math.isfinite(sq):
            x64 = x.astype(np.float64)
            sq = float(np.dot(x64, x64))
        total += sq
    return math.sqrt(total)


def lower_median(values: list[float]) -> float:
    """The ⌈K/2⌉-th smallest value: one outlier among K ≥ 3 cannot move it, and it is the smaller of two."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def first_nonfinite(state: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first tensor holding a NaN/Inf, or None when the whole state is finite."""
    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


@dataclass
class Verdict:
    """What the bounds say of one round: clients to leave out (-> why) and weights to cap (client -> n)."""

    dropped: dict[str, str] = field(default_factory=dict)
    capped: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.dropped or self.capped)

    def record(self) -> dict:
        return {"dropped": dict(self.dropped), "capped": dict(self.capped)}


class RoundGuard:
    """Collects (n_k, ‖Δ_k‖) of a round's folded updates and judges them at the close (module docstring).

    A factor of 0 turns its bound off. Both bounds need at least two updates: a lone update has no peer to
    be compared with (the non-finite rule still applies to it).
    """

    def __init__(self, samples_factor: float, norm_factor: float) -> None:
        self.samples_factor = samples_factor
        self.norm_factor = norm_factor
        self.facts: dict[str, tuple[int, float]] = {}  # client -> (n_samples, ‖Δ‖)

    def begin(self) -> None:
        self.facts = {}

    def note(self, update: ClientUpdate, global_state: Mapping[str, torch.Tensor]) -> None:
        norm = delta_norm(update, global_state) if self.norm_factor > 0 else 0.0
        self.facts[update.client] = (int(update.n_samples), norm)

    def verdict(self) -> Verdict:
        out = Verdict()
        if len(self.facts) < 2:
            return out
        if self.norm_factor > 0:
            ref = lower_median([norm for _, norm in self.facts.values()])
            bound = self.norm_factor * ref
            for client, (_, norm) in sorted(self.facts.items()):
                if ref > 0 and norm > bound:
                    out.dropped[client] = f"update norm {norm:.3g} > {self.norm_factor:g} x median {ref:.3g}"
        if self.samples_factor > 0:
            cap = max(1, int(self.samples_factor * lower_median([n for n, _ in self.facts.values()])))
            for client, (n, _) in sorted(self.facts.items()):
                if n > cap and client not in out.dropped:
                    out.capped[client] = cap
        return out
