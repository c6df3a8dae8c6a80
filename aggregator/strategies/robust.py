"""Guards against outlier or malicious updates.

* :class:`ClippedFedAvg` — streaming. Δ_k = θ_k − θ; if the global L2 norm ‖Δ_k‖ (over all tensors) exceeds
  ``clip_norm`` the delta is scaled to that norm; θ ← θ + Σ n_k Δ̃_k / Σ n_k. One model-sized buffer.
* :class:`TrimmedMean` — coordinate-wise trimmed mean (``trim`` = fraction cut from *each* end, floor(trim·K)
  values) or median (``trim=0.5``; even K averages the two middle values), unweighted by n_k (weights would
  let one client claim a large n_k and defeat the trimming). A coordinate-wise order statistic needs every
  update at once, so it cannot be streamed in O(model): it keeps a copy of each update — memory is
  (K + 1) models — and refuses more than ``max_updates`` folds with a StrategyError instead of growing
  without bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from fedmq.aggregator.strategies._common import (
    acc_dtype,
    cast_like,
    check_started,
    full_tensor,
    update_sq_norm,
    validate_update,
)
from fedmq.aggregator.strategies.base import ClientUpdate, State, Strategy
from fedmq.aggregator.strategies.fedavg import FedAvg
from fedmq.checks import check_int, check_number
from fedmq.errors import StrategyError


class ClippedFedAvg(FedAvg):
    """FedAvg whose client weight is n_k·min(1, clip_norm / ‖Δ_k‖)."""

    name: ClassVar[str] = "fedavg-clip"

    @classmethod
    def from_config(cls, cfg: Any, **extra: Any) -> Strategy:
        return cls.from_settings(cfg, {"clip_norm": ("robust", float(cfg.robust.partition(":")[2]))}, **extra)

    def __init__(self, clip_norm: float = 10.0) -> None:
        super().__init__()
        self.clip_norm = check_number("clip_norm", clip_norm, low=0.0, low_open=True)
        self.clipped: list[str] = []

    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        super().begin(global_state)
        self.clipped = []

    def weight(self, update: ClientUpdate) -> float:
        g = check_started(self._global, self.name)
        norm = math.sqrt(sum(update_sq_norm(update, g, k) for k in update.tensors))
        if norm <= self.clip_norm:
            return float(update.n_samples)
        self.clipped.append(update.client)
        return update.n_samples * self.clip_norm / norm


class TrimmedMean(Strategy):
    name: ClassVar[str] = "trimmed-mean"

    @classmethod
    def from_config(cls, cfg: Any, **extra: Any) -> Strategy:
        job = {
            "trim": ("robust", float(cfg.robust.partition(":")[2])),
            "max_updates": ("clients", max(cfg.clients, 1)),
        }
        return cls.from_settings(cfg, job, **extra)

    def __init__(self, trim: float = 0.1, max_updates: int = 64) -> None:
        self.trim = check_number("trim", trim, low=0.0, high=0.5, high_open=False)
        self.max_updates = check_int("max_updates", max_updates, low=1)
        self._global: Mapping[str, torch.Tensor] | None = None
        self._kept: list[dict[str, torch.Tensor]] = []
        self._clients: list[str] = []

    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        self._global = global_state
        self._kept, self._clients = [], []

    def fold(self, update: ClientUpdate) -> None:
        g = check_started(self._global, self.name)
        validate_update(update, g, need_samples=False)
        if len(self._kept) >= self.max_updates:
            raise StrategyError(f"{self.name}: more than max_updates={self.max_updates} updates in one round")
        # full_tensor of a delta update is already a new tensor: copy only when it is the caller's
        self._kept.append(
            {
                k: full_tensor(update, g, k).detach().to(acc_dtype(g[k]), copy=not update.delta)
                for k in update.tensors
            }
        )
        self._clients.append(update.client)

    def finish(self) -> State:
        g = check_started(self._global, self.name)
        K = len(self._kept)
        if K == 0:
            out = {k: v.clone() for k, v in g.items()}
        else:
            out = {}
            for name in g:
                stacked, _ = torch.sort(torch.stack([u[name] for u in self._kept]), dim=0)
                if self.trim >= 0.5:
                    lo, hi = (K - 1) // 2, K // 2
                    out[name] = (stacked[lo] + stacked[hi]) / 2
                else:
                    cut = math.floor(self.trim * K)
                    out[name] = stacked[cut : K - cut].mean(dim=0)
                del stacked
            out = cast_like(out, g)
        self._last_weights = {c: 1.0 / K for c in self._clients} if K else {}
        self._global, self._kept = None, []
        return out


class Median(TrimmedMean):
    """The coordinate-wise median: the mean trimmed all the way in."""

    name: ClassVar[str] = "median"

    def __init__(self, max_updates: int = 64) -> None:
        super().__init__(trim=0.5, max_updates=max_updates)

    @classmethod
    def from_config(cls, cfg: Any, **extra: Any) -> Strategy:
        return cls.from_settings(cfg, {"max_updates": ("clients", max(cfg.clients, 1))}, **extra)
