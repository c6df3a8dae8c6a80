"""fedmq's own client hooks (fedmq.hooks): what a job may do to every upload, whatever its strategy. The job's
settings choose them (aggregator.strategies.registry.client_map) and they run after the strategy's own hook,
in this order:

- ``Randomization``: FedAtt's noise before upload;
- ``DynamicPulling``: Passban et al.'s choice of the tensors that go up (and, both ways, of those that come
  down);
- ``ErrorFeedback``: what a sparsified upload left out rides on the next one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import ClassVar

import torch

from fedmq.errors import BadParameter
from fedmq.hooks import ClientHook, Kept, State, stable_seed
from fedmq.pulling import MODES, SHARES, select_tensors
from fedmq.tasks.base import TrainResult


class Randomization(ClientHook):
    """FedAtt's randomization (Ji et al., Eq. 6): the client adds ``sigma``·N(0, 1) to every tensor it
    uploads, with noise drawn per (job seed, client, round), so a run repeats exactly. It states no ε (no clip
    bound, no accountant): differential privacy is fedmq.privacy.client_dp."""

    name: ClassVar[str] = "noise"

    def __init__(self, sigma: float) -> None:
        if not 0 < sigma < math.inf:
            raise BadParameter(f"noise: sigma must be positive and finite, got {sigma}")
        self.sigma = sigma

    def finish(self, trained: State, result: TrainResult, kept: Kept) -> State:
        ctx = self.context
        gen = torch.Generator().manual_seed(stable_seed(ctx.seed, ctx.client, ctx.round, "noise"))
        return {k: v + self.sigma * torch.randn(v.shape, generator=gen) for k, v in trained.items()}


class DynamicPulling(ClientHook):
    """Dynamic pulling (Passban et al. 2022, fedmq.pulling): the client uploads only the tensors the rule
    ``mode`` picks (a ``fraction`` of the parameters, or of the tensors with ``by="count"``) by their change
    since its own previous upload. The tensors it did not send stay its own: "protected from external
    updates and only modified using local data", so its next training starts from them. With ``down`` the
    server also pushes only its pick; the client then keeps its own values for the rest (``own_state``)."""

    name: ClassVar[str] = "pulling"

    def __init__(self, mode: str, fraction: float = 0.5, by: str = "params", down: bool = False) -> None:
        if mode not in MODES or mode == "all":
            raise BadParameter(f"pulling: mode must be one of {', '.join(m for m in MODES if m != 'all')}")
        if by not in SHARES:
            raise BadParameter(f"pulling: by must be one of {', '.join(SHARES)}")
        if not 0 < fraction < 1:
            raise BadParameter(f"pulling: fraction must be in (0, 1), got {fraction}")
        self.mode, self.fraction, self.by, self.down = mode, fraction, by, down

    def own_state(self, kept: Kept) -> State | None:
        return kept.get("own", legacy="own")

    def start(self, global_state: State, kept: Kept) -> State:
        # under pull-down the server pushed only its pick and the agent laid it over our own values
        private = None if self.down else kept.get("private", legacy="private")
        return global_state if private is None else {**global_state, **private}

    def finish(self, trained: State, result: TrainResult, kept: Kept) -> State:
        ctx = self.context
        names = select_tensors(
            trained,
            kept.get("own", legacy="own"),
            ctx.groups,
            self.mode,
            self.fraction,
            random.Random(stable_seed(ctx.seed, ctx.client, ctx.round, "pull")),
            self.by,
        )
        kept.put("own", trained)
        if not self.down:
            picked = set(names)
            kept.put("private", {k: v for k, v in ctx.trained.items() if k not in picked})
        return {k: trained[k] for k in names}


class ErrorFeedback(ClientHook):
    """Error feedback for sparsified deltas (Stich et al. 2018, "Sparsified SGD with memory"; Lin et al.
    2018, Deep Gradient Compression): keep e = (Δ + e_prev) − what the aggregator will decode, and add it to
    the next upload, so no coordinate's change is dropped for good, only delayed. e lives in parameter space,
    so it still applies when the next round starts from a newer global model; it is lost with the agent's
    store (a restart of a service loses only the correction)."""

    name: ClassVar[str] = "error-feedback"

    def __init__(self) -> None:
        self._residual: State | None = None  # e_prev, read in finish
        self._upload: State = {}  # Δ + e_prev as uploaded, before encoding

    def finish(self, trained: State, result: TrainResult, kept: Kept) -> State:
        self._residual = kept.get("residual", legacy="residual")
        if self._residual is not None:
            trained = {k: v + self._residual[k] for k, v in trained.items()}
        self._upload = trained
        return trained

    def sent(self, update: Mapping[str, torch.Tensor], kept: Kept) -> None:
        held = self.context.held
        left = {k: (v - held[k]) - update[k] for k, v in self._upload.items()}
        kept.put("residual", {**(self._residual or {}), **left})
