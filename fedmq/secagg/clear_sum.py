"""A secure sum's arithmetic in the clear: what a client's update becomes once SecAgg+ has quantized it, so
that a plain job measures the accuracy a secure one would reach.

Masks cancel exactly in Z_{2^32}, so what the server unmasks is the sum of the clients' quantized inputs
(fedmq.secagg.quantize): each clips its update Δ to [-c, c] coordinate by coordinate, scales it by its weight
w = min(n_k, n_max) / n_max, quantizes w · clip(Δ) to b bits with stochastic rounding, and the server divides
the decoded sum by Σ w. :class:`QuantizedUpload` is that client side without the masks: it uploads
Δ̂ = decode(quantize(w · clip(Δ))) / w with its usual n_k, so that FedAvg's Σ n_k Δ̂_k / Σ n_k is
Σ decode(…)_k / Σ w_k, the secure mean, exactly where no client is capped (n_k ≤ n_max); the weight's own
b-bit rounding (relative error below 2^-(b-1)) is left out. The rounding draws from the job's seed, the client
and the round, so a run repeats.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from fedmq.errors import BadParameter, SecAggError
from fedmq.hooks import ClientHook, Kept, State, stable_seed
from fedmq.secagg.quantize import Quantizer
from fedmq.tasks.base import TrainResult


class QuantizedUpload(ClientHook):
    """A client's update as a secure sum of ``clients`` inputs with clipping range ``clip`` would carry it
    (module docstring); ``max_samples`` is the job's n_max."""

    name: ClassVar[str] = "clear-sum"

    def __init__(self, clip: float, clients: int, max_samples: int) -> None:
        try:
            self.quantizer = Quantizer.for_clients(clients, clip)
        except SecAggError as exc:
            raise BadParameter(f"clear-sum: {exc}") from None
        if max_samples < 1:
            raise BadParameter(f"clear-sum: max_samples must be at least 1, got {max_samples}")
        self.max_samples = max_samples

    def finish(self, trained: State, result: TrainResult, kept: Kept) -> State:
        ctx, q = self.context, self.quantizer
        w = min(result.n_samples, self.max_samples) / self.max_samples
        rng = np.random.default_rng(stable_seed(ctx.seed, ctx.client, ctx.round, "clear-sum"))
        out: State = {}
        for name, value in trained.items():
            base = ctx.held[name].double()
            delta = (value.double() - base).numpy().reshape(-1)
            sent = q.decode_sum(q.encode(np.clip(delta, -q.clip, q.clip) * w, rng), 1) / w
            out[name] = (base + torch.from_numpy(sent).reshape(value.shape)).to(value.dtype)
        return out
