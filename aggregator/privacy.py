"""A job's differential-privacy plan, derived once from its settings (docs/guide/privacy.md): the clip
norm S, the noise multipliers, δ, the sampling rate the accountant assumes and the fixed denominator of
DP-FedAvg. Torch-free, so `fedmq simulate` can state it before training starts.

Sampling: a synchronous round samples every online client independently with probability q = C (Poisson
sampling, fedmq.privacy.accountant.poisson_sample), which is what the accountant assumes; a client offline
when sampled does not contribute. FedSGD selects everyone (q = 1). Asynchronous mode admits whoever is online
and arrives first, which is no sampling the accountant can amplify with: each published version is accounted
as a release with q = 1, each client contributing at most once a version (the engine enforces it).

The denominator: the expected number of contributors, qK in a synchronous round (K under FedSGD), the buffer
size K in asynchronous mode. The noised sum is divided by it, never by the number that came, so a client's
weight is bounded by S/denominator whatever n_k it claims (n_k weighting is off under DP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fedmq.privacy.accountant import (
    Accountant,
    default_delta,
    noise_for_epsilon,
    update_noise_for_adaptive_clipping,
)

DEFAULT_NOISE_MULTIPLIER = 1.0  # z when neither it nor a target ε is given
# adaptive clipping (Andrew et al. 2021, "Differentially private learning with adaptive clipping", their
# experiments' settings): the first S, the geometric step's learning rate η_C, and the noise on the clipped
# count σ_b = expected contributors / 20, but at least z (the update's share of the noise, z_Δ, exists only
# while 2σ_b > z: with σ_b = z it is z/√(3/4), 15 % more noise on the update)
ADAPTIVE_INITIAL_CLIP = 0.1
ADAPTIVE_LEARNING_RATE = 0.2
COUNT_NOISE_SHARE = 1 / 20


@dataclass(frozen=True)
class DPPlan:
    mode: str  # central | client
    clip_norm: float  # S (adaptive: the first S; the strategy state carries the current one)
    adaptive: bool
    quantile: float  # adaptive: the target quantile γ
    noise_multiplier: float  # z: what the accountant charges
    update_noise: float  # z_Δ: the update sum's noise is z_Δ·S (= z unless adaptive takes a share)
    count_stddev: float  # adaptive: σ_b, the noise on the clipped count (else 0)
    delta: float
    sampling_rate: float  # q
    denominator: float  # the expected contributors a release (module docstring)
    min_count: int  # client mode: each share is sized so that this many give the full noise
    rounds: int  # the releases planned
    target_epsilon: float | None

    def accountant(self) -> Accountant:
        return Accountant(self.sampling_rate, self.noise_multiplier, self.delta)

    def describe(self) -> dict[str, Any]:
        """What the run folder and `fedmq simulate` state of the plan."""
        return {
            "mode": self.mode,
            "clip_norm": "adaptive" if self.adaptive else self.clip_norm,
            "noise_multiplier": self.noise_multiplier,
            "delta": self.delta,
            "sampling_rate": self.sampling_rate,
            "denominator": self.denominator,
            "planned_rounds": self.rounds,
            "planned_epsilon": self.accountant().epsilon_after(self.rounds),
        }


def dp_plan(cfg: Any, buffer_size: int = 0) -> DPPlan | None:
    """The plan of the job ``cfg`` (a JobConfig; None without DP); ``buffer_size``: an asynchronous
    strategy's K."""
    if cfg.dp == "none":
        return None
    if cfg.mode == "async":
        rate, denominator = 1.0, float(buffer_size)
    elif cfg.plan.select_all:
        rate, denominator = 1.0, float(cfg.clients)
    else:
        rate, denominator = float(cfg.fraction), cfg.fraction * cfg.clients
    return _plan(
        cfg.dp,
        cfg.clip_norm,
        cfg.clip_quantile,
        cfg.noise_multiplier,
        cfg.target_epsilon,
        cfg.delta,
        cfg.clients,
        cfg.rounds,
        cfg.min_clients,
        rate,
        max(denominator, 1.0),
    )


@lru_cache(maxsize=16)  # a round's strategy is built afresh every round; the search for z runs once
def _plan(
    mode: str,
    clip_norm: float | str,
    quantile: float,
    z: float | None,
    target: float | None,
    delta: float | None,
    clients: int,
    rounds: int,
    min_count: int,
    rate: float,
    denominator: float,
) -> DPPlan:
    delta = default_delta(clients) if delta is None else delta
    if z is None:
        z = DEFAULT_NOISE_MULTIPLIER if target is None else noise_for_epsilon(target, delta, rate, rounds)
    adaptive = clip_norm == "adaptive"
    count_stddev = max(denominator * COUNT_NOISE_SHARE, z) if adaptive else 0.0
    update_noise = update_noise_for_adaptive_clipping(z, count_stddev) if adaptive and z > 0 else z
    return DPPlan(
        mode=mode,
        clip_norm=ADAPTIVE_INITIAL_CLIP if adaptive else float(clip_norm),
        adaptive=adaptive,
        quantile=quantile,
        noise_multiplier=z,
        update_noise=update_noise,
        count_stddev=count_stddev,
        delta=delta,
        sampling_rate=rate,
        denominator=denominator,
        min_count=min_count,
        rounds=rounds,
        target_epsilon=target,
    )


def finite_or_none(value: float) -> float | None:
    """ε as a record keeps it: a number, or None for an unbounded one (z = 0)."""
    return value if math.isfinite(value) else None
