"""FedMed's adaptive aggregation (Wu et al. 2020, §3.2), folded one client at a time; and two variants.

The paper, §3.2 (its sub- and superscripts, the ‖ of KL and JS, ← , − and ∇ written out; the text is the
paper's):

    "The variant of KL divergence, i.e., Jensen-Shannon divergence is used for dealing with the asymmetric
    problem of KL divergence, and each round of disparity between two matrices is given by:

        d_k^l = JS(w^l ‖ w_k^l) = KL(w^l ‖ (w^l + w_k^l)/2)/2 + KL(w_k^l ‖ (w^l + w_k^l)/2)/2    (2)

    Then, the ratio of each worker model is recorded by calculating the disparity with the softmax function
    to implement the aggregation. Please note that the ratio of worker model is layer-wise, and so each round
    applies to the adaptive computation. The projection of probability space can be written as:

        γ_k^l = softmax(d_k^l) = e^{d_k^l} / Σ_{k=1} e^{d_k^l}    (3)

    [...] The weights of server model update each round can be defined as:

        w_{t+1} ← w_t − η Σ_{k=1}^{u} γ_k^l ∇L(w_t)    (5)

    where η is the learning rate and w_t is the global server parameters at the time of round t."

``fedmed`` computes (2), (3) and (5) as written. Where the paper is silent: a layer's weights become a
distribution by a softmax of the flattened tensor ("the projection of probability space"), so per tensor l

    d_k^l = JS(softmax(θ^l.flatten()) ‖ softmax(θ_k^l.flatten()))   in nats (0 ≤ d ≤ ln 2),
    γ_k^l = softmax_k(d_k^l),   kept with a running log-sum-exp,
    θ^l ← θ^l − η Σ_k γ_k^l (θ^l − θ_k^l) = (1 − η) θ^l + η Σ_k γ_k^l θ_k^l,

the worker's step θ^l − θ_k^l standing for (5)'s gradient term. η defaults to 1.0 (the paper gives no server
step size for FedMed): the new model is then a convex combination of the client models, the same scale as the
FedAvg rounds the loss switch alternates with. The mediator's loss switch (aggregator.mediator) picks, each
round, this adaptive aggregation or plain FedAvg: the plan's ``loss_switch`` has the engine run a FedAvg round
when it says so (aggregator.sync_round).

On trained models the formula is inert: JS between a client's layer and the global one is ~1e-6 nats and
differs between clients by less than that, so γ is close to uniform and a FedMed round is nearly an
unweighted mean of the client models. That is the paper's method, and what ``fedmed`` runs.

Variants (their own names; each changes only how d_k^l becomes γ_k^l, and needs the whole round's scores
first, so the engine folds its round twice: ``second_pass`` returns per-tensor temperatures and the round is
refolded from its spool with ``temperatures=``):

* ``fedmed-standardised``: γ_k^l = softmax_k((d_k^l − mean_j d_j^l) / sd_j d_j^l), a per-layer temperature
  sd_l (the mean cancels in a softmax). It exists to make the weights differ between clients at JS ~1e-6
  nats. It is degenerate at two clients a round: any two different values standardise to ±1, so every
  tensor splits 0.881 / 0.119 however close the divergences are. The earlier ``cpu`` results were made
  with it.
* ``fedmed-relative``: γ_k^l = softmax_k(d_k^l / mean_j d_j^l): scale-free like the standardised form, equal
  divergences give equal weights at any m, and the weights follow the ratios (two clients at 1.15 : 0.93 of
  the mean get 0.55 / 0.45). It exists to remove the two-client degeneracy; against standardised it was not
  resolved on validation (docs/results/method.md), and it has no measured effect against FedAvg. The later
  ``cpu`` and the ``paper`` results were made with it.

Runs made with a variant are reported under the variant's name, never as FedMed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import ClassVar

import torch

from fedmq.aggregator.strategies._common import full_tensor
from fedmq.aggregator.strategies.base import ClientUpdate, RoundPlan, State
from fedmq.aggregator.strategies.softmax_weighted import SoftmaxWeighted
from fedmq.checks import check_number
from fedmq.errors import BadParameter, StrategyError
from fedmq.train_config import TrainConfig

# how d_k^l becomes γ_k^l: the paper's softmax of JS, or a variant's softmax of JS over a per-layer
# temperature
JS_WEIGHTS = ("raw", "relative", "standardised")
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
    """The paper's FedMed aggregation: γ_k^l = softmax_k(JS_k^l) (module docstring)."""

    name: ClassVar[str] = "fedmed"
    # the mediator (FedMed §3.4) needs every report first: top-K ranks the losses at the end of local
    # training, and the loss switch picks FedMed's adaptive aggregation or FedAvg from their mean
    plan: ClassVar[RoundPlan] = RoundPlan(grant_phase=True, loss_switch=True)
    # how JS becomes a weight (JS_WEIGHTS): "raw" is the paper's; the variants below set their own
    js: ClassVar[str] = "raw"

    @classmethod
    def configure_train(cls, train: TrainConfig) -> TrainConfig:
        return dataclasses.replace(train, tail_loss=True)

    def __init__(self, eta: float = 1.0, temperatures: Mapping[str, float] | None = None) -> None:
        """``eta``: the server step η of Eq. (5); ``temperatures``: a variant's per-tensor temperatures,
        given by the engine on the second pass (``second_pass``); the paper's form has none."""
        super().__init__()
        self.eta = self.step_size = check_number("eta", eta, low=0.0, low_open=True)
        if self.js not in JS_WEIGHTS:
            raise BadParameter(
                f"{self.name}: JS weights must be one of {', '.join(JS_WEIGHTS)}, got {self.js!r}"
            )
        # variants: None on the first pass (scores only), then the per-layer sd (standardised) or mean
        # (relative) of JS over the round
        self.temperatures = None if temperatures is None else {k: float(v) for k, v in temperatures.items()}

    @property
    def _scoring_only(self) -> bool:
        return self.js != "raw" and self.temperatures is None

    def score(self, name: str, update: ClientUpdate) -> float:
        g = self._global
        d = js_divergence(g[name], full_tensor(update, g, name))  # type: ignore[index, arg-type]
        if self.js == "raw" or self.temperatures is None:
            return d
        t = self.temperatures.get(name, 0.0)
        # one client, or all equal: equal weights
        return d / t if t > 0 else 0.0

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
        # a variant's first pass: JS scores only, the weighted sum comes on the second pass
        if self._scoring_only:
            self.score_only(update)
        else:
            super().fold(update)

    def finish(self) -> State:
        if self._scoring_only and self._global is not None:
            raise StrategyError(
                f"{self.name}: {self.js} JS weights need the second pass (second_pass) before finish"
            )
        return super().finish()


class FedMedRelative(FedMed):
    """Variant of FedMed: γ_k^l = softmax_k(JS_k^l / mean_j JS_j^l), two passes (module docstring)."""

    name: ClassVar[str] = "fedmed-relative"
    js: ClassVar[str] = "relative"


class FedMedStandardised(FedMed):
    """Variant of FedMed: γ_k^l = softmax_k((JS_k^l − mean_j JS_j^l) / sd_j JS_j^l), two passes; degenerate at
    two clients (module docstring)."""

    name: ClassVar[str] = "fedmed-standardised"
    js: ClassVar[str] = "standardised"
