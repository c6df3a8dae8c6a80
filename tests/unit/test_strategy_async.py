"""Buffered asynchronous aggregation: staleness weights, the drop, deltas and the buffer."""

from __future__ import annotations

import pytest
import torch

from fedmq.aggregator.strategies.base import ClientUpdate
from fedmq.aggregator.strategies.buffered_async import BufferedAsync
from fedmq.aggregator.strategies.errors import StaleUpdate
from fedmq.errors import BadParameter, StrategyError
from fedmq.staleness import staleness_weight

GLOBAL = {"w": torch.tensor([1.0, 1.0])}


def test_staleness_weights():
    assert staleness_weight(0) == 1.0
    assert staleness_weight(3) == 0.5  # 1/sqrt(4)
    assert staleness_weight(8) == pytest.approx(1 / 3)


def test_hand_worked_buffer():
    s = BufferedAsync(buffer_size=2, max_staleness=3)
    s.begin(GLOBAL)
    # fresh update as full weights: Δ_a = [3,1] − [1,1] = [2,0], s(0) = 1
    s.fold(ClientUpdate("a", 1, {"w": torch.tensor([3.0, 1.0])}, staleness=0))
    assert s.pending == 1
    # stale update as a delta: Δ_b = [0,4], s(3) = 1/2
    s.fold(ClientUpdate("b", 1, {"w": torch.tensor([0.0, 4.0])}, staleness=3, delta=True))
    assert s.pending == 2 == s.buffer_size
    out = s.finish()
    # θ' = [1,1] + (1·1·[2,0] + ½·1·[0,4]) / (1 + 1) = [1,1] + [1,1] = [2,2]
    assert torch.equal(out["w"], torch.tensor([2.0, 2.0]))
    assert s.client_weights() == {"a": 0.5, "b": 0.25}


def test_server_lr_and_sample_weights():
    s = BufferedAsync(buffer_size=2, server_lr=0.5)
    s.begin(GLOBAL)
    s.fold(ClientUpdate("a", 3, {"w": torch.tensor([5.0, 1.0])}))  # Δ = [4, 0]
    s.fold(ClientUpdate("b", 1, {"w": torch.tensor([1.0, 5.0])}))  # Δ = [0, 4]
    # θ' = [1,1] + 0.5·(3·[4,0] + 1·[0,4]) / 4 = [1,1] + [1.5, 0.5]
    assert torch.equal(s.finish()["w"], torch.tensor([2.5, 1.5]))


def test_too_stale_is_dropped_and_changes_nothing():
    s = BufferedAsync(buffer_size=1, max_staleness=3)
    s.begin(GLOBAL)
    with pytest.raises(StaleUpdate, match="4 versions stale \\(max 3\\)") as info:
        s.fold(ClientUpdate("a", 1, {"w": torch.ones(2)}, staleness=4, delta=True))
    assert info.value.staleness == 4 and s.pending == 0 and s.dropped == 1
    assert torch.equal(s.finish()["w"], GLOBAL["w"])


def test_stale_update_without_delta_and_bad_staleness_are_rejected():
    s = BufferedAsync()
    s.begin(GLOBAL)
    with pytest.raises(StrategyError, match="needs a delta update"):
        s.fold(ClientUpdate("a", 1, {"w": torch.zeros(2)}, staleness=1))
    with pytest.raises(StrategyError, match="staleness must be an integer"):
        s.fold(ClientUpdate("a", 1, {"w": torch.zeros(2)}, staleness=-1))
    with pytest.raises(StrategyError, match="has shape"):
        s.fold(ClientUpdate("a", 1, {"w": torch.zeros(3)}, staleness=1, delta=True))
    assert s.pending == 0


@pytest.mark.parametrize(
    "params", [{"buffer_size": 0}, {"max_staleness": -1}, {"server_lr": 0.0}, {"buffer_size": 2.5}]
)
def test_bad_parameters(params):
    with pytest.raises(BadParameter):
        BufferedAsync(**params)
