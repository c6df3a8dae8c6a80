"""Robust guards (clipping, trimmed mean, median) and the strategy registry."""

from __future__ import annotations

import pytest
import torch

from fedmq.aggregator.strategies.base import ClientUpdate, Strategy
from fedmq.aggregator.strategies.dynamic_pull import DynamicPull
from fedmq.aggregator.strategies.fedatt import FedAtt
from fedmq.aggregator.strategies.registry import STRATEGY_NAMES, make_strategy
from fedmq.aggregator.strategies.robust import ClippedFedAvg, TrimmedMean
from fedmq.errors import BadParameter, FedmqError, StrategyError


def run(strategy, glob, updates):
    strategy.begin(glob)
    for u in updates:
        strategy.fold(u)
    return strategy.finish()


def test_clipping_hand_worked():
    s = ClippedFedAvg(clip_norm=1.0)
    # Δ_a = [3,4], norm 5 → clipped to [0.6, 0.8]; Δ_b = [0.3, 0.4], norm 0.5 → kept; mean = [0.45, 0.6]
    out = run(
        s,
        {"w": torch.zeros(2)},
        [
            ClientUpdate("a", 1, {"w": torch.tensor([3.0, 4.0])}),
            ClientUpdate("b", 1, {"w": torch.tensor([0.3, 0.4])}),
        ],
    )
    torch.testing.assert_close(out["w"], torch.tensor([0.45, 0.6]))
    assert s.clipped == ["a"]


def test_trimmed_mean_and_median_hand_worked():
    vals = [0.0, 1.0, 2.0, 100.0]
    ups = [ClientUpdate(str(i), 1, {"w": torch.tensor([v, -v])}) for i, v in enumerate(vals)]
    # trim 0.25 of 4 → drop 1 from each end per coordinate: mean(1, 2) = 1.5 and mean(-2, -1) = -1.5
    assert torch.equal(
        run(TrimmedMean(trim=0.25), {"w": torch.zeros(2)}, ups)["w"], torch.tensor([1.5, -1.5])
    )
    # median of 4 averages the two middle values; of 3 ([0, 1, 100]) it is the middle one
    assert torch.equal(run(TrimmedMean(trim=0.5), {"w": torch.zeros(2)}, ups)["w"], torch.tensor([1.5, -1.5]))
    assert torch.equal(
        run(TrimmedMean(trim=0.5), {"w": torch.zeros(2)}, [ups[0], ups[1], ups[3]])["w"],
        torch.tensor([1.0, -1.0]),
    )


def test_trimmed_mean_refuses_more_than_its_memory_bound():
    s = TrimmedMean(max_updates=2)
    s.begin({"w": torch.zeros(2)})
    for i in range(2):
        s.fold(ClientUpdate(str(i), 1, {"w": torch.ones(2)}))
    with pytest.raises(StrategyError, match="max_updates=2"):
        s.fold(ClientUpdate("x", 1, {"w": torch.ones(2)}))


def test_registry_builds_every_name():
    for name in STRATEGY_NAMES:
        assert isinstance(make_strategy(name), Strategy)
    assert (
        isinstance(make_strategy("pull-random"), DynamicPull)
        and make_strategy("pull-random").plan.pull == "random"
    )
    s = make_strategy("fedatt", epsilon=1.0, norm="spectral")
    assert isinstance(s, FedAtt) and s.epsilon == 1.0 and s.norm == "spectral"
    assert make_strategy("median").trim == 0.5


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("fedfoo", {}, "unknown strategy 'fedfoo'"),
        ("fedavg", {"epsilon": 1}, "has no parameter 'epsilon'; it takes no parameters"),
        ("fedatt", {"eps": 1}, "has no parameter 'eps'; it takes epsilon, norm"),
        ("pull-local", {"rule": "global"}, "has no parameter 'rule'"),
        ("fedatt", {"epsilon": -1}, r"strategy 'fedatt': epsilon \(--eps\) must be > 0.0"),
        ("async", {"buffer_size": "ten"}, "buffer_size must be a whole number, got 'ten'"),
        ("fedadam", {"tau": 0}, "tau=0.0 is out of range"),
        ("fedprox", {"mu": "big"}, "mu must be a number, got 'big'"),
    ],
)
def test_registry_rejects_bad_input_with_one_line(name, params, message):
    with pytest.raises(BadParameter, match=message) as info:
        make_strategy(name, **params)
    assert isinstance(info.value, FedmqError) and "\n" not in str(info.value)
