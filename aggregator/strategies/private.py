"""Client-level differential privacy as a wrapper every averaging strategy takes (DP-FedAvg: McMahan et al.
2018, Algorithm 1; Geyer et al. 2017). ``registry.strategy_from_config`` wraps the job's strategy in it when
the job sets ``dp``, the one place it is applied.

Central mode: each update's change Δ_k (every tensor it uploads, one L2 norm) is clipped to S and summed; at
``finish`` the sum gets N(0, z_Δ²S²) per coordinate and is divided by the fixed denominator D (the expected
contributors: aggregator/privacy.py), never by the number that came or their n_k. Client mode: the agents
clipped and noised (fedmq/privacy/client_dp.py); an update whose norm exceeds what a clipped, noised update
can have is refused, the rest summed and divided by D, with N(0, z²S² − v) added first where the shares'
variance v in the sum falls short of z²S² (asynchronous staleness weights shrink a share with its change).

The noised mean change is then folded into the wrapped strategy as one update from the model the round
started from (n_k = 1), so FedAvg adds it, the server optimizers (FedAvgM, FedAdam …) step on it, FedProx
averages it as FedAvg does, and the asynchronous buffer moves by η_g times it. Asynchronous staleness
weights s(τ) ≤ 1 scale each clipped update before the sum (the bound stays S). SCAFFOLD: the control-variate
changes it uploads are clipped and noised together with the model's (one norm over the whole upload), so
neither leaks unnoised; the server's c moves by D/N times their noised mean, the paper's |S|/N with the
expected |S|.

Adaptive clipping (Andrew et al. 2021, Algorithm 1): with b_k = 1 when ‖Δ_k‖ ≤ S, the noised fraction
b̄ = (Σ (b_k − 1/2) + N(0, σ_b²))/D + 1/2 moves S ← S·exp(−η_C(b̄ − γ)) toward the target quantile γ.
S is strategy state: ``state_dict`` carries it to the next round and into every checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from fedmq.aggregator.privacy import ADAPTIVE_LEARNING_RATE, DPPlan
from fedmq.aggregator.strategies._common import check_started, check_sums, validate_update, zeros_like_state
from fedmq.aggregator.strategies.base import ClientUpdate, PartialSum, State, Strategy
from fedmq.aggregator.strategies.scaffold import Scaffold
from fedmq.errors import StrategyError
from fedmq.privacy.mechanism import add_gaussian, clip, noise_generator, plausible_norm, update_norm
from fedmq.staleness import staleness_weight

CLIP_KEY = "dp.clip_norm"  # the current S in the strategy state (adaptive clipping)
CLIP_RANGE = (1e-9, 1e9)  # a kept S outside it is refused (check_state)
MEAN = "dp-mean"  # the one update the wrapped strategy folds: the noised mean change
TOP_UP_TOLERANCE = 1e-9  # client mode: a shortfall below this share of z²S² is float rounding, not noise


class Private(Strategy):
    """``inner`` under the job's DP plan (module docstring). Its name, plan and round shape are the inner
    strategy's; its state is the inner one's plus the current clip norm."""

    name: ClassVar[str] = "dp"

    def __init__(self, inner: Strategy, plan: DPPlan) -> None:
        self.inner, self.dp = inner, plan
        self.name = inner.name  # type: ignore[misc]  # the round runs, and its state is kept, under it
        self.plan = inner.plan  # type: ignore[misc]
        self.per_tensor_state = inner.per_tensor_state  # type: ignore[misc]
        for attr in ("buffer_size", "max_staleness"):  # the asynchronous window (async_rounds.async_window)
            if hasattr(inner, attr):
                setattr(self, attr, getattr(inner, attr))
        if isinstance(inner, Scaffold):  # c moves by D/N × the noised mean (module docstring)
            inner.population = inner.population / plan.denominator  # type: ignore[assignment]
        self.clip_norm = plan.clip_norm
        self.generator: torch.Generator = noise_generator(None)  # the engine sets the release's own
        self._global: Mapping[str, torch.Tensor] | None = None
        self._sum: State = {}
        self._count = 0
        self._unclipped = 0  # adaptive: updates within S
        self._noise_var = 0.0  # client mode: the variance of the noise the clients' shares put in the sum

    def draw_from(self, seed: int | None, release: int) -> None:
        """Noise for this release from the OS CSPRNG, or (``seed`` given: `fedmq simulate`) from the job's
        seed and the release, so a re-run or a resumed run adds the same noise."""
        self.generator = noise_generator(seed, "dp", release)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        state = self.inner.state_dict()
        return {**state, CLIP_KEY: self.clip_norm} if self.dp.adaptive else state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.dp.adaptive and CLIP_KEY in state:
            self.clip_norm = float(state[CLIP_KEY])
        self.inner.load_state_dict({k: v for k, v in state.items() if k != CLIP_KEY})

    def check_state(self, state: Mapping[str, Any], model: Mapping[str, torch.Tensor]) -> str | None:
        if CLIP_KEY in state:
            s = state[CLIP_KEY]
            low, high = CLIP_RANGE
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not low <= s <= high:
                return f"{CLIP_KEY}: {s!r} is not a clip norm in [{low:g}, {high:g}]"
        return self.inner.check_state({k: v for k, v in state.items() if k != CLIP_KEY}, model)

    # ------------------------------------------------------------------ aggregation
    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        self._global = global_state
        self._sum = zeros_like_state(global_state)
        self._noise_var = 0.0
        self._count = self._unclipped = 0
        self.inner.begin(global_state)

    def fold(self, update: ClientUpdate) -> None:
        g = check_started(self._global, self.name)
        validate_update(update, g, need_samples=False)
        admit = getattr(self.inner, "admit", None)
        if admit is not None:
            admit(update)  # the wrapped strategy's own refusals (asynchronous: too stale)
        delta = {k: t if update.delta else t - g[k] for k, t in update.tensors.items()}
        if self.dp.mode == "central":
            delta, norm = clip(delta, self.clip_norm)
            self._unclipped += norm <= self.clip_norm
        else:
            numel = sum(t.numel() for t in delta.values())
            norm, bound = update_norm(delta), plausible_norm(self.clip_norm, self._share_std, numel)
            if not norm <= bound:
                raise StrategyError(
                    f"update from {update.client!r}: norm {norm:.4g} exceeds {bound:.4g}, the most a "
                    "clipped, noised update can have (was it clipped?)"
                )
        weight = staleness_weight(update.staleness) if self.plan.mode == "async" else 1.0
        for name, t in delta.items():
            self._sum[name].add_(t.to(self._sum[name].dtype), alpha=weight)
        self._count += 1
        self._noise_var += (weight * self._share_std) ** 2  # client mode: its share, weighed as its change

    @property
    def weighs_samples(self) -> bool:
        """Every contribution counts 1 (its n_k would tell the aggregator something): under secure
        aggregation each client weighs itself by 1."""
        return False

    def fold_partial(self, part: PartialSum) -> None:
        """A secure sum of clipped, noised changes, each of weight 1 (distributed DP under secure aggregation,
        aggregator.secure_round): ``part.sums`` is their sum, ``part.terms`` names the clients in it. Client
        mode only: central mode clips each update here, which a sum cannot be. Nothing is added unless all
        fits."""
        g = check_started(self._global, self.name)
        if self.dp.mode != "client":
            raise StrategyError("a secure sum runs under dp client only (central clips each update here)")
        check_sums(part.sums, g, "secure sum")
        for name, acc in part.sums.items():
            self._sum[name].add_(acc.to(self._sum[name].dtype))
        self._count += len(part.terms)
        # each client's share is whole: a stale one is topped up after its weighing (ClientDP.weigh)
        self._noise_var += len(part.terms) * self._share_std**2

    @property
    def _share_std(self) -> float:
        return self.dp.noise_multiplier * self.clip_norm / math.sqrt(self.dp.min_count)

    def finish(self) -> State:
        check_started(self._global, self.name)
        if self.dp.mode == "central":
            add_gaussian(self._sum, self.dp.update_noise * self.clip_norm, self.generator)
        else:
            add_gaussian(self._sum, self._top_up(), self.generator)
        mean = {k: v.div_(self.dp.denominator) for k, v in self._sum.items()}
        if self.dp.adaptive:
            self._adapt()
        self.inner.fold(ClientUpdate(MEAN, 1, mean, delta=True))
        self._global, self._sum = None, {}
        return self.inner.finish()

    def _top_up(self) -> float:
        """Client mode: the std of the noise the aggregator adds so that the sum carries the z·S the
        accountant charges. The clients' shares give it when at least m_min came at full weight;
        asynchronous staleness weights s(τ) < 1 shrink a share with its change, which leaves the sum short
        (a fresh update still moves it by S): the aggregator adds what is missing."""
        needed = (self.dp.update_noise * self.clip_norm) ** 2
        missing = needed - self._noise_var
        return math.sqrt(missing) if missing > needed * TOP_UP_TOLERANCE else 0.0

    def _adapt(self) -> None:
        """Andrew et al.'s geometric step of S toward the target quantile, on the noised clipped count."""
        noise = float(torch.randn((), generator=self.generator, dtype=torch.float64))
        # the summands b_k − 1/2 (sensitivity 1/2: the count's noise multiplier is 2σ_b, as accounted)
        centred = self._unclipped - self._count / 2 + self.dp.count_stddev * noise
        fraction = centred / self.dp.denominator + 0.5
        low, high = CLIP_RANGE
        step = math.exp(-ADAPTIVE_LEARNING_RATE * (fraction - self.dp.quantile))
        self.clip_norm = min(max(self.clip_norm * step, low), high)

    def client_weights(self) -> dict[str, float]:
        """None: each client's weight would tell its n_k or its norm (every one is 1/D, at most)."""
        return {}
