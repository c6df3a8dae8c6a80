"""Dynamic-pulled aggregation: per-tensor FedAvg over the senders; unsent tensors keep the server value."""

from __future__ import annotations

import pytest
import torch

from fedmq.aggregator.strategies.base import ClientUpdate
from fedmq.aggregator.strategies.dynamic_pull import DynamicPull
from fedmq.errors import StrategyError

GLOBAL = {"w": torch.tensor([1.0, 1.0]), "b": torch.tensor([5.0]), "c": torch.tensor([9.0, 9.0])}


def test_hand_worked_per_tensor_average():
    s = DynamicPull()
    s.begin(GLOBAL)
    s.fold(ClientUpdate("a", 1, {"w": torch.tensor([3.0, 3.0])}))
    s.fold(ClientUpdate("b", 3, {"w": torch.tensor([7.0, 7.0]), "b": torch.tensor([1.0])}))
    out = s.finish()
    # w: sent by a (n=1) and b (n=3): (1·3 + 3·7) / 4 = 6
    assert torch.equal(out["w"], torch.tensor([6.0, 6.0]))
    # b: sent by b only: 1 (the server's 5 does not enter the average)
    assert torch.equal(out["b"], torch.tensor([1.0]))
    # c: nobody sent it: the server's value, as a copy
    assert torch.equal(out["c"], GLOBAL["c"]) and out["c"] is not GLOBAL["c"]
    # client weights: mean over the 3 tensors of its share of each (a: ¼ of w; b: ¾ of w, all of b)
    w = s.client_weights()
    assert w["a"] == pytest.approx(0.25 / 3) and w["b"] == pytest.approx((0.75 + 1.0) / 3)


def test_all_tensors_sent_equals_fedavg():
    s = DynamicPull()
    s.begin(GLOBAL)
    s.fold(ClientUpdate("a", 1, {k: torch.zeros_like(v) for k, v in GLOBAL.items()}))
    s.fold(ClientUpdate("b", 1, {k: 2 * torch.ones_like(v) for k, v in GLOBAL.items()}))
    assert all(torch.equal(v, torch.ones_like(v)) for v in s.finish().values())


def test_empty_or_unknown_subset_is_rejected():
    s = DynamicPull()
    s.begin(GLOBAL)
    with pytest.raises(StrategyError, match="no tensors"):
        s.fold(ClientUpdate("a", 1, {}))
    with pytest.raises(StrategyError, match="unknown tensor 'zz'"):
        s.fold(ClientUpdate("a", 1, {"zz": torch.ones(1)}))
    assert torch.equal(s.finish()["w"], GLOBAL["w"])
