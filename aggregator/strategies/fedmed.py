"""FedMed adaptive aggregation (Wu et al. 2020), folded one client at a time.

Per tensor l: JS_k = JS(softmax(θ^l.flatten()) ‖ softmax(θ_k^l.flatten())) with natural logarithms (so
0 ≤ JS ≤ ln 2), γ_k = softmax_k(JS_k) kept with a running log-sum-exp, and

    θ^l ← θ^l − η Σ_k γ_k (θ^l − θ_k^l) = (1 − η) θ^l + η Σ_k γ_k θ_k^l.

η defaults to 1.0 (the paper gives no server step size for FedMed): the new model is then a convex
combination of the client models, the same scale as the FedAvg rounds the loss switch alternates with.

The mediator's loss switch (aggregator.mediator) picks, each round, this adaptive aggregation or plain FedAvg:
the plan's ``loss_switch`` has the engine run a FedAvg round when it says so (aggregator.sync_round).

``js = "relative"`` (the default) and ``"standardised"`` depart from the paper's literal
γ_k = softmax_k(JS_k): with a softmax of each flattened layer, JS between a client and the global model is
~1e-6 nats and varies between clients by less than that, so γ stays within 0.3 % of uniform and "adaptive"
aggregation is equal-weight FedAvg. Standardised, each layer's JS is taken relative to the round's spread: γ_k
= softmax_k((JS_k − mean)/sd); the mean cancels in a softmax, so this is a per-layer temperature sd_l. sd_l is
only known once every update of the round has been scored, so the round is folded twice (``second_pass``: the
engine refolds it from its spool with the temperatures, ``temperatures=``).
``js = "raw"`` is the paper's literal formula.

Standardised weights are degenerate at two clients a round: any two different values standardise to ±1, so γ
is 0.881 / 0.119 however close the divergences are. ``js = "relative"`` divides each layer's JS by the round's
mean instead, γ_k = softmax_k(JS_k / mean_j JS_j): scale-free like the standardised form (JS ~1e-6 nats does
not matter), equal divergences give equal weights at any m, and the weights move smoothly with the ratios (two
clients at 1.15 : 0.93 of the mean get 0.55 / 0.45). Chosen on validation over standardised
(docs/results/method.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from fedmq.aggregator.strategies._common import full_tensor
from fedmq.aggregator.strategies.base import ClientUpdate, RoundPlan, State
from fedmq.aggregator.strategies.softmax_weighted import SoftmaxWeighted
from fedmq.broker.wire.messages import RoundConfig
from fedmq.checks import check_number
from fedmq.errors import BadParameter, StrategyError

JS_WEIGHTS = ("standardised", "relative", "raw")
TWO_PASS = ("standardised", "relative")  # their temperatures need every score of the round first
_CHUNK = 1 << 20
_LN2 = math.log(2.0)


def js_divergence(a: torch.Tensor, b: torch.Tensor) -> float:
    """JS(softmax(a.flatten()) ‖ softmax(b.flatten())) in nats, computed in float64 chunks
    (bounded memory)."""
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


class FedMed(SoftmaxWeighted):
    name: ClassVar[str] = "fedmed"
    # the mediator (FedMed §3.4) needs every report first: top-K ranks the losses at the end of local
    # training, and the loss switch picks FedMed's adaptive aggregation or FedAvg from their mean
    plan: ClassVar[RoundPlan] = RoundPlan(grant_phase=True, loss_switch=True)
    own_settings: ClassVar[tuple[str, ...]] = ("fedmed_js",)

    @classmethod
    def from_config(cls, cfg: Any, **extra: Any) -> FedMed:
        return cls(js=cfg.fedmed_js, **extra)

    @classmethod
    def configure_train(cls, train: RoundConfig) -> RoundConfig:
        return dataclasses.replace(train, tail_loss=True)

    def __init__(
        self, eta: float = 1.0, js: str = "relative", temperatures: Mapping[str, float] | None = None
    ) -> None:
        super().__init__()
        self.eta = self.step_size = check_number("eta", eta, low=0.0, low_open=True)
        if js not in JS_WEIGHTS:
            raise BadParameter(f"fedmed js must be one of {', '.join(JS_WEIGHTS)}, got {js!r}")
        self.js = js
        # two-pass forms: None on the first pass (scores only), then the per-layer sd (standardised) or mean
        # (relative) of JS over the round
        self.temperatures = None if temperatures is None else {k: float(v) for k, v in temperatures.items()}

    @property
    def _scoring_only(self) -> bool:
        return self.js in TWO_PASS and self.temperatures is None

    def score(self, name: str, update: ClientUpdate) -> float:
        g = self._global
        d = js_divergence(g[name], full_tensor(update, g, name))  # type: ignore[index, arg-type]
        if self.js == "raw" or self.temperatures is None:
            return d
        t = self.temperatures.get(name, 0.0)
        return d / t if t > 0 else 0.0  # one client, or all equal: equal weights

    def second_pass(self, exclude: frozenset[str] = frozenset()) -> dict | None:
        if not self._scoring_only:
            return None
        temps: dict[str, float] = {}
        kept = [sc for c, sc in self._scores.items() if c.rstrip("'") not in exclude]
        for name in kept[0] if kept else {}:
            values = [sc[name] for sc in kept]
            mean = math.fsum(values) / len(values)
            temps[name] = (
                mean
                if self.js == "relative"
                else math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
            )
        return {"temperatures": temps}

    def fold(self, update: ClientUpdate) -> None:
        if self._scoring_only:  # first pass: JS scores only, the weighted sum comes on the second pass
            self.score_only(update)
        else:
            super().fold(update)

    def finish(self) -> State:
        if self._scoring_only and self._global is not None:
            raise StrategyError(
                f"fedmed: {self.js} JS weights need the second pass (second_pass) before finish"
            )
        return super().finish()
