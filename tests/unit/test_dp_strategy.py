"""The DP wrapper every averaging strategy takes (aggregator/strategies/private.py): clipping, the noise on
the clipped sum, the fixed denominator, client mode's norm check, adaptive clipping and its state."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from fedmq.aggregator.config import DP_STRATEGIES, JobConfig
from fedmq.aggregator.privacy import dp_plan
from fedmq.aggregator.strategies.base import ClientUpdate, PartialSum, Strategy
from fedmq.aggregator.strategies.private import CLIP_KEY, Private
from fedmq.aggregator.strategies.registry import client_hooks, strategy_from_config
from fedmq.errors import BadParameter, StrategyError
from fedmq.hooks import ClientContext
from fedmq.privacy.client_dp import ClientDP
from fedmq.privacy.mechanism import update_norm

# K = 10 clients, C = 0.5: the fixed denominator is qK = 5
CFG = JobConfig(dp="central", clients=10, fraction=0.5, clip_norm=2.0, noise_multiplier=1.0)
MODEL = {"w": torch.zeros(1_000_000), "b": torch.zeros(10)}


def _strategy(cfg: JobConfig = CFG, seed: int | None = 0, release: int = 1) -> Private:
    _, strategy = strategy_from_config(cfg.strategy, cfg)
    assert isinstance(strategy, Private)
    strategy.draw_from(seed, release)
    return strategy


def _round(strategy: Strategy, updates: list[ClientUpdate], model=MODEL) -> dict[str, torch.Tensor]:
    strategy.load_state_dict({})
    strategy.begin(model)
    for u in updates:
        strategy.fold(u)
    return strategy.finish()


def _change(value: float, numel: int = 1_000_000) -> dict[str, torch.Tensor]:
    return {"w": torch.full((numel,), value), "b": torch.full((10,), value)}


def test_every_averaging_strategy_is_wrapped_and_keeps_its_name():
    for name in DP_STRATEGIES:
        cfg = dataclasses.replace(CFG, strategy=name)
        got, strategy = strategy_from_config(name, cfg)
        assert isinstance(strategy, Private) and strategy.name == got == name


def test_the_noise_on_the_mean_has_std_z_s_over_the_denominator():
    out = _round(_strategy(), [ClientUpdate("a", 7, _change(0.0), delta=True)])
    # z·S/D = 1 · 2 / 5
    assert float(out["w"].std()) == pytest.approx(0.4, rel=0.02)
    assert abs(float(out["w"].mean())) < 0.4 * 0.01


def test_a_clipped_update_moves_the_model_by_at_most_s_over_the_denominator():
    cfg = dataclasses.replace(CFG, noise_multiplier=0.0)
    for value in (1e-4, 0.5, 30.0):
        out = _round(_strategy(cfg), [ClientUpdate("a", 3, _change(value), delta=True)])
        assert update_norm(out) <= 2.0 / 5 * (1 + 1e-5)
        expected = min(update_norm(_change(value)), 2.0) / 5
        assert update_norm(out) == pytest.approx(expected, rel=1e-4)


def test_the_denominator_is_fixed_whatever_n_k_or_the_count():
    cfg = dataclasses.replace(CFG, noise_multiplier=0.0)
    small = _round(_strategy(cfg), [ClientUpdate("a", 1, _change(1e-4), delta=True)])
    huge = _round(_strategy(cfg), [ClientUpdate("a", 10**9, _change(1e-4), delta=True)])
    assert all(torch.equal(small[k], huge[k]) for k in small)
    assert float(small["w"][0]) == pytest.approx(1e-4 / 5, rel=1e-5)  # divided by qK = 5, not by n = 1
    two = _round(
        _strategy(cfg),
        [ClientUpdate("a", 1, _change(1e-4), delta=True), ClientUpdate("b", 99, _change(1e-4), delta=True)],
    )
    assert float(two["w"][0]) == pytest.approx(2e-4 / 5, rel=1e-5)


def test_no_client_weight_is_exported():
    strategy = _strategy()
    _round(strategy, [ClientUpdate("a", 7, _change(0.1), delta=True)])
    assert strategy.client_weights() == {}


def test_seeded_noise_repeats_per_release():
    u = [ClientUpdate("a", 7, _change(0.0), delta=True)]
    a, b = _round(_strategy(release=3), u), _round(_strategy(release=3), u)
    c = _round(_strategy(release=4), u)
    assert torch.equal(a["w"], b["w"]) and not torch.equal(a["w"], c["w"])


def test_client_mode_sums_without_noise_and_refuses_an_unclipped_update():
    cfg = dataclasses.replace(CFG, dp="client", min_clients=4)
    hooks = client_hooks(cfg)
    assert hooks[-1][0] is ClientDP
    assert hooks[-1][1] == {"clip_norm": 2.0, "noise_std": pytest.approx(1.0 * 2.0 / math.sqrt(4))}
    strategy = _strategy(cfg)
    out = _round(strategy, [ClientUpdate(c, 7, _change(1e-4), delta=True) for c in "abcd"])
    assert float(out["w"][0]) == pytest.approx(4e-4 / 5, rel=1e-5)  # m_min shares: nothing added
    strategy = _strategy(cfg)
    strategy.begin(MODEL)
    with pytest.raises(StrategyError, match="exceeds"):
        strategy.fold(ClientUpdate("a", 7, _change(10.0), delta=True))  # norm 10⁴: never a noised S = 2


def _noised(std: float, seed: int, numel: int = 1_000_000) -> dict[str, torch.Tensor]:
    """A client-mode change of nothing but its noise share."""
    gen = torch.Generator().manual_seed(seed)
    return {"w": std * torch.randn(numel, generator=gen), "b": std * torch.randn(10, generator=gen)}


def test_client_mode_tops_up_the_noise_that_staleness_weights_take_from_an_asynchronous_sum():
    """Two clients' shares σ = z·S/√2 give the release z·S when both are fresh; at τ = 3 (s = 1/2) each share
    shrinks with its change, and the aggregator adds what is missing: the mean's noise stays z·S/D."""
    cfg = dataclasses.replace(
        CFG, dp="client", min_clients=2, strategy="async", strategy_args={"buffer_size": 4}
    )
    share = 1.0 * 2.0 / math.sqrt(2)
    fresh = [ClientUpdate(c, 1, _noised(share, i), delta=True) for i, c in enumerate("ab")]
    out = _round(_strategy(cfg), fresh)
    summed = (fresh[0].tensors["w"] + fresh[1].tensors["w"]) / 4  # η_g = 1: nothing added
    torch.testing.assert_close(out["w"], summed)
    stale = [dataclasses.replace(u, staleness=3) for u in fresh]
    out = _round(_strategy(cfg), stale)
    assert float(out["w"].std()) == pytest.approx(1.0 * 2.0 / 4, rel=0.02)  # z·S/D, not half of it
    added = out["w"] - summed / 2  # N(0, (1 − s²)·z²S²) over D
    assert float(added.std()) == pytest.approx(math.sqrt(1 - 1 / 4) * 2.0 / 4, rel=0.02)


def test_a_stale_client_weighs_its_change_and_keeps_a_whole_noise_share():
    """Secure asynchronous buffers: the client weighs itself by s(τ) and tops its share back up to σ."""
    hook = ClientDP(clip_norm=2.0, noise_std=0.5)
    hook.context = ClientContext("a", 3, 0, seed=0)
    hook.context.noise_seed = 0
    gen = torch.Generator().manual_seed(1)
    change = (0.01 + 0.5 * torch.randn(1_000_000, generator=gen)).numpy()
    out = hook.weigh(change, 0.25, rnd=7)
    assert out.dtype == change.dtype and out.shape == change.shape
    assert float(out.std()) == pytest.approx(0.5, rel=0.01)
    assert float(out.mean()) == pytest.approx(0.0025, abs=2e-3)
    topped = out - 0.25 * change  # the top-up: drawn apart from the share it completes
    assert abs(float(np.corrcoef(topped, change)[0, 1])) < 0.01
    assert (hook.weigh(change, 0.25, rnd=7) == out).all()  # seeded (`fedmq simulate`): it repeats
    assert (hook.weigh(change, 1.0, rnd=7) == change).all()  # a fresh change is its own share
    with pytest.raises(BadParameter, match="staleness weight"):
        hook.weigh(change, 0.0, rnd=7)


def test_a_secure_sum_of_m_min_whole_shares_gets_nothing_added_and_a_smaller_one_is_topped_up():
    """fold_partial counts each client's share whole (a stale one topped itself up): a sum of m_min of them
    carries z·S; one of fewer gets the rest from the aggregator, from the release's seeded generator."""
    cfg = dataclasses.replace(CFG, dp="client", min_clients=4)
    share = 1.0 * 2.0 / math.sqrt(4)

    def secure(count: int, release: int = 1) -> dict[str, torch.Tensor]:
        noise = [_noised(share, i) for i in range(count)]
        sums = {k: sum(n[k] for n in noise) for k in MODEL}
        strategy = _strategy(cfg, release=release)
        strategy.load_state_dict({})
        strategy.begin(MODEL)
        names = {f"c{i}": 1.0 for i in range(count)}
        strategy.fold_partial(PartialSum(sums, {k: (count, count) for k in MODEL}, count, names))
        return {"sum": sums["w"] / 5, **strategy.finish()}

    whole = secure(4)
    torch.testing.assert_close(whole["w"], whole["sum"])  # ÷ D = 5, nothing added
    short = secure(1)
    assert float((short["w"] - short["sum"]).std()) == pytest.approx(math.sqrt(1 - 1 / 4) * 2.0 / 5, rel=0.02)
    assert torch.equal(secure(1)["w"], short["w"]) and not torch.equal(secure(1, release=2)["w"], short["w"])


def _adaptive(quantile: float) -> JobConfig:
    return dataclasses.replace(
        CFG, clients=200, fraction=0.5, clip_norm="adaptive", clip_quantile=quantile, noise_multiplier=0.5
    )


@pytest.mark.parametrize(("norm", "direction"), [(50.0, 1), (1e-6, -1)])
def test_adaptive_clipping_moves_s_toward_the_quantile(norm, direction):
    cfg = _adaptive(0.5)
    model = {"w": torch.zeros(100)}
    state: dict = {}
    history = []
    for release in range(1, 9):
        strategy = _strategy(cfg, release=release)
        strategy.load_state_dict(state)
        strategy.begin(model)
        for i in range(100):  # the expected count qK
            strategy.fold(ClientUpdate(f"c{i}", 1, {"w": torch.full((100,), norm / 10)}, delta=True))
        strategy.finish()
        state = strategy.state_dict()
        assert strategy.check_state(state, model) is None
        history.append(state[CLIP_KEY])
    # all above S: S grows; all below: S shrinks (Andrew et al.'s geometric step, ×e^{±0.1} at most)
    steps = [b / a for a, b in zip(history, history[1:])]
    assert all((s > 1) if direction > 0 else (s < 1) for s in steps)


def test_a_kept_clip_norm_out_of_range_is_refused():
    strategy = _strategy(_adaptive(0.5))
    assert "clip norm" in (strategy.check_state({CLIP_KEY: -1.0}, MODEL) or "")
    assert strategy.check_state({CLIP_KEY: 0.3}, MODEL) is None


def test_the_plan_samples_at_c_and_async_is_accounted_without_sampling():
    plan = dp_plan(CFG)
    assert plan is not None and plan.sampling_rate == 0.5 and plan.denominator == 5
    assert plan.delta == pytest.approx(1 / 10**1.1)
    cfg = dataclasses.replace(CFG, strategy="async", strategy_args={"buffer_size": 4})
    _, strategy = strategy_from_config("async", cfg)
    assert isinstance(strategy, Private) and strategy.dp.sampling_rate == 1.0 and strategy.dp.denominator == 4
    fedsgd = dp_plan(dataclasses.replace(CFG, strategy="fedsgd"))
    assert fedsgd is not None and fedsgd.sampling_rate == 1.0 and fedsgd.denominator == 10


def test_a_target_epsilon_gives_the_z_that_spends_it_over_the_planned_rounds():
    cfg = dataclasses.replace(CFG, noise_multiplier=None, target_epsilon=3.0, rounds=20)
    plan = dp_plan(cfg)
    assert plan is not None
    acc = plan.accountant()
    assert acc.epsilon_after(20) <= 3.0 * (1 + 1e-6)
    assert acc.epsilon_after(20) == pytest.approx(3.0, rel=0.01)
