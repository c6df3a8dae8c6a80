"""Guards against outlier or malicious updates (issue 9).

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
from typing import ClassVar, Mapping

import torch

from aggregator.strategies._common import (
    acc_dtype,
    cast_like,
    check_int,
    check_number,
    check_started,
    sq_distance,
    validate_update,
    zeros_like_state,
)
from aggregator.strategies.base import ClientUpdate, State, Strategy
from aggregator.strategies.errors import StrategyError


class ClippedFedAvg(Strategy):
    name: ClassVar[str] = "fedavg-clip"

    def __init__(self, clip_norm: float = 10.0) -> None:
        self.clip_norm = check_number("clip_norm", clip_norm, low=0.0, low_open=True)
        self._global: Mapping[str, torch.Tensor] | None = None
        self._acc: State = {}
        self._n = 0
        self._samples: dict[str, int] = {}
        self.clipped: list[str] = []

    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        self._global = global_state
        self._acc = zeros_like_state(global_state)
        self._n = 0
        self._samples = {}
        self.clipped = []

    def fold(self, update: ClientUpdate) -> None:
        g = check_started(self._global, self.name)
        validate_update(update, g)
        sq = sum(sq_distance(t.to(acc_dtype(g[k])), g[k].to(acc_dtype(g[k]))) for k, t in update.tensors.items())
        norm = math.sqrt(sq)
        scale = 1.0 if norm <= self.clip_norm else self.clip_norm / norm
        if scale < 1.0:
            self.clipped.append(update.client)
        w = update.n_samples * scale
        for name, t in update.tensors.items():
            self._acc[name].add_(t, alpha=w).add_(g[name], alpha=-w)
        self._n += update.n_samples
        self._samples[update.client] = self._samples.get(update.client, 0) + update.n_samples

    def finish(self) -> State:
        g = check_started(self._global, self.name)
        if self._n == 0:
            out = {k: v.clone() for k, v in g.items()}
        else:
            out = cast_like({k: a.div_(self._n).add_(g[k]) for k, a in self._acc.items()}, g)
        self._last_weights = {c: n / self._n for c, n in self._samples.items()} if self._n else {}
        self._global, self._acc = None, {}
        return out


class TrimmedMean(Strategy):
    name: ClassVar[str] = "trimmed-mean"

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
        self._kept.append({k: t.detach().to(acc_dtype(g[k]), copy=True) for k, t in update.tensors.items()})
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
