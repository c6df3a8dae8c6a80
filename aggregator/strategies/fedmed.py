"""FedMed adaptive aggregation (Wu et al. 2020), folded one client at a time, plus the mediator's mode switch.

Per tensor l: JS_k = JS(softmax(θ^l.flatten()) ‖ softmax(θ_k^l.flatten())) with natural logarithms (so
0 ≤ JS ≤ ln 2), γ_k = softmax_k(JS_k) kept with a running log-sum-exp, and

    θ^l ← θ^l − η Σ_k γ_k (θ^l − θ_k^l) = (1 − η) θ^l + η Σ_k γ_k θ_k^l.

η defaults to 1.0 (the paper gives no server step size for FedMed): the new model is then a convex
combination of the client models, the same scale as the FedAvg rounds the loss switch alternates with.

``mode`` is what the mediator's loss switch picked for the round ("adaptive" or "fedavg"); set it with
``set_mode`` before ``begin``. In "fedavg" mode the round is plain n_k-weighted FedAvg.
"""

from __future__ import annotations

import math
from typing import ClassVar, Mapping

import torch

from aggregator.strategies._common import (
    RunningSoftmaxSum,
    cast_like,
    check_number,
    check_score,
    check_started,
    validate_update,
    zeros_like_state,
)
from aggregator.strategies.base import ClientUpdate, State, Strategy
from aggregator.strategies.errors import BadParameter, StrategyError
from aggregator.strategies.fedatt import softmax_dict
from aggregator.strategies.fedavg import FedAvg

MODES = ("adaptive", "fedavg")
_CHUNK = 1 << 20
_LN2 = math.log(2.0)


def js_divergence(a: torch.Tensor, b: torch.Tensor) -> float:
    """JS(softmax(a.flatten()) ‖ softmax(b.flatten())) in nats, computed in float64 chunks (bounded memory)."""
    x, y = a.reshape(-1), b.reshape(-1)
    lse_a = float(torch.logsumexp(x.double(), 0)) if x.numel() <= _CHUNK else _chunked_lse(x)
    lse_b = float(torch.logsumexp(y.double(), 0)) if y.numel() <= _CHUNK else _chunked_lse(y)
    total = 0.0
    for i in range(0, x.numel(), _CHUNK):
        lp = x[i : i + _CHUNK].double() - lse_a
        lq = y[i : i + _CHUNK].double() - lse_b
        lm = torch.logaddexp(lp, lq) - _LN2
        total += 0.5 * float((lp.exp() * (lp - lm)).sum() + (lq.exp() * (lq - lm)).sum())
    return max(total, 0.0) if math.isfinite(total) else total


def _chunked_lse(x: torch.Tensor) -> float:
    parts = torch.stack([torch.logsumexp(x[i : i + _CHUNK].double(), 0) for i in range(0, x.numel(), _CHUNK)])
    return float(torch.logsumexp(parts, 0))


class FedMed(Strategy):
    name: ClassVar[str] = "fedmed"

    def __init__(self, eta: float = 1.0, mode: str = "adaptive") -> None:
        self.eta = check_number("eta", eta, low=0.0, low_open=True)
        self.mode = "adaptive"
        self.set_mode(mode)
        self._fedavg = FedAvg()
        self._global: Mapping[str, torch.Tensor] | None = None
        self._sums: dict[str, RunningSoftmaxSum] = {}
        self._scores: dict[str, dict[str, float]] = {}
        self._active_mode = self.mode
        self._last_weights: dict[str, float] = {}

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise BadParameter(f"fedmed mode must be one of {', '.join(MODES)}, got {mode!r}")
        if getattr(self, "_global", None) is not None:
            raise StrategyError("fedmed: set_mode must be called before begin(), not inside a round")
        self.mode = mode

    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        self._active_mode = self.mode
        self._global = global_state
        if self._active_mode == "fedavg":
            self._fedavg.begin(global_state)
            return
        self._sums = {k: RunningSoftmaxSum(v) for k, v in zeros_like_state(global_state).items()}
        self._scores = {}

    def fold(self, update: ClientUpdate) -> None:
        g = check_started(self._global, self.name)
        if self._active_mode == "fedavg":
            self._fedavg.fold(update)
            return
        validate_update(update, g, need_samples=False, check_finite=False)
        scores = {name: js_divergence(g[name], t) for name, t in update.tensors.items()}
        for name, s in scores.items():
            check_score(update, name, s)
        for name, t in update.tensors.items():
            self._sums[name].add(scores[name], t)
        key = update.client
        while key in self._scores:
            key += "'"
        self._scores[key] = scores

    def finish(self) -> State:
        g = check_started(self._global, self.name)
        if self._active_mode == "fedavg":
            out = self._fedavg.finish()
            self._last_weights = self._fedavg.client_weights()
        elif not self._scores:
            out = {k: v.clone() for k, v in g.items()}
            self._last_weights = {}
        else:
            out = {name: s.mean().mul_(self.eta).add_(g[name], alpha=1.0 - self.eta) for name, s in self._sums.items()}
            out = cast_like(out, g)
            tensors = list(next(iter(self._scores.values())))
            total = {c: 0.0 for c in self._scores}
            for name in tensors:
                for c, w in softmax_dict({c: sc[name] for c, sc in self._scores.items()}).items():
                    total[c] += w
            self._last_weights = {c: v / len(tensors) for c, v in total.items()}
        self._global, self._sums = None, {}
        return out

    def state_dict(self) -> dict:
        return {"mode": self.mode}

    def load_state_dict(self, state: dict) -> None:
        if "mode" in state:
            self.set_mode(state["mode"])
