"""Client-mode differential privacy (``--dp client``): each selected agent clips its own update and adds its
share of the noise before upload, so the aggregator only ever sees noised updates (the mode that composes with
secure aggregation). A client hook (fedmq.hooks), run after the strategy's own hook.

The share: N(0, σ²) per coordinate with σ = z·S/√m_min, where m_min is the fewest updates the aggregator
closes a round with (its ``min_clients``): a round that closes holds at least m_min shares, so its sum carries
at least the variance z²S² the accountant assumes, whoever dropped out (more contributors only add noise).
A change weighed by an asynchronous staleness weight s(τ) < 1 loses part of its share with it: the aggregator
tops the sum up (aggregator.strategies.private), or, in a secure buffer, where the server sees only the sum,
the client does (``ClientDP.weigh``).
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch

from fedmq.errors import BadParameter
from fedmq.hooks import ClientHook, Kept, State
from fedmq.privacy.mechanism import add_gaussian, clip, noise_generator
from fedmq.tasks.base import TrainResult


def share_std(noise_multiplier: float, clip_norm: float, min_count: int) -> float:
    """σ of one client's noise share: z·S/√m_min (module docstring)."""
    return noise_multiplier * clip_norm / math.sqrt(min_count)


class ClientDP(ClientHook):
    """Clip the change from the model trained from (every uploaded tensor, one L2 norm) to ``clip_norm`` and
    add N(0, ``noise_std``²) to each coordinate. The noise comes from the OS CSPRNG, or in `fedmq simulate`
    from the job's seed (ClientContext.noise_seed)."""

    name: ClassVar[str] = "dp"
    # 2: a stale member of a secure buffer tops its weighed share up (``weigh``); an agent of version 1 would
    # not, so a job's announcement of version 2 turns it away
    version: ClassVar[int] = 2

    def __init__(self, clip_norm: float, noise_std: float) -> None:
        if not 0 < clip_norm < math.inf:
            raise BadParameter(f"dp: clip_norm must be positive and finite, got {clip_norm}")
        if not 0 <= noise_std < math.inf:
            raise BadParameter(f"dp: noise_std must be >= 0 and finite, got {noise_std}")
        self.clip_norm, self.noise_std = clip_norm, noise_std

    def finish(self, trained: State, result: TrainResult, kept: Kept) -> State:
        ctx = self.context
        base = ctx.held
        delta = {k: v.detach().float() - base[k].float() for k, v in trained.items()}
        clipped, _ = clip(delta, self.clip_norm)
        add_gaussian(clipped, self.noise_std, noise_generator(ctx.noise_seed, ctx.client, ctx.round, "dp"))
        return {k: (base[k].float() + clipped[k]).to(trained[k].dtype) for k in trained}

    def weigh(self, change: np.ndarray, weight: float, rnd: int) -> np.ndarray:
        """``weight`` · ``change`` (clipped and noised by ``finish``; a float32 vector, as the secure upload's
        flat change is) plus N(0, (1 − weight²)·σ²), drawn from a stream of its own: a change
        weighed by its staleness s(τ) ≤ 1 keeps a whole share of the noise, so its sum still carries z·S while
        it moves the model by at most s(τ)·S. For a secure asynchronous buffer, whose clients weigh themselves
        (the server learns only the sum, and tops up none of it); ``rnd``: the buffer's round."""
        if not 0.0 < weight <= 1.0:
            raise BadParameter(f"dp: a staleness weight is within (0, 1], not {weight}")
        out = torch.from_numpy(np.asarray(change, dtype=np.float32) * np.float32(weight))
        ctx = self.context
        rng = noise_generator(ctx.noise_seed, ctx.client, rnd, "dp-stale")
        add_gaussian({"change": out}, self.noise_std * math.sqrt(1.0 - weight * weight), rng)
        return out.numpy()
