"""FedAvg / FedSGD against hand-worked numbers, order independence and rejection of bad updates."""

from __future__ import annotations

import itertools

import pytest
import torch

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.strategies.base import ClientUpdate
from fedmq.aggregator.strategies.fedavg import FedAvg, FedSGD
from fedmq.errors import StrategyError

GLOBAL = {"w": torch.tensor([0.0, 0.0]), "b": torch.tensor([0.0])}
UPDATES = [
    ClientUpdate("a", 1, {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([4.0])}),
    ClientUpdate("b", 2, {"w": torch.tensor([4.0, 5.0]), "b": torch.tensor([1.0])}),
    ClientUpdate("c", 1, {"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([0.0])}),
]


def run(strategy, updates, glob=GLOBAL):
    strategy.begin(glob)
    for u in updates:
        strategy.fold(u)
    return strategy.finish()


def test_fedavg_hand_worked():
    out = run(FedAvg(), UPDATES)
    # n = 1 + 2 + 1 = 4; w = (1·[1,2] + 2·[4,5] + 1·[3,0]) / 4 = [12, 12] / 4 = [3, 3]
    assert torch.equal(out["w"], torch.tensor([3.0, 3.0]))
    # b = (1·4 + 2·1 + 1·0) / 4 = 1.5
    assert torch.equal(out["b"], torch.tensor([1.5]))


def test_fedavg_client_weights_are_sample_shares():
    s = FedAvg()
    run(s, UPDATES)
    assert s.client_weights() == {"a": 0.25, "b": 0.5, "c": 0.25}


def test_fedsgd_aggregates_like_fedavg_after_one_full_batch_step_of_every_client():
    assert torch.equal(run(FedSGD(), UPDATES)["w"], torch.tensor([3.0, 3.0]))
    cfg = JobConfig(job="j", strategy="fedsgd", clients=7, fraction=0.1, epochs=3, max_steps=5)
    train = cfg.train_config()
    assert cfg.selected_count() == 7 and train.full_batch and train.epochs == 1 and train.max_steps == 0


def test_fold_order_does_not_matter():
    gen = torch.Generator().manual_seed(0)
    glob = {"w": torch.randn(50, 7, generator=gen)}
    ups = [ClientUpdate(str(i), i + 1, {"w": torch.randn(50, 7, generator=gen)}) for i in range(4)]
    ref = run(FedAvg(), ups, glob)["w"]
    for perm in itertools.permutations(ups):
        s = FedAvg()
        s.begin(glob)
        for u in perm:
            s.fold(u)
        torch.testing.assert_close(s.finish()["w"], ref, rtol=1e-6, atol=1e-6)


def test_no_update_returns_global_unchanged_and_does_not_alias():
    out = run(FedAvg(), [])
    assert torch.equal(out["w"], GLOBAL["w"]) and out["w"] is not GLOBAL["w"]


@pytest.mark.parametrize(
    "bad, message",
    [
        (ClientUpdate("x", 1, {"w": torch.tensor([1.0, 1.0])}), "missing tensor 'b'"),
        (
            ClientUpdate("x", 1, {"w": torch.ones(2), "b": torch.ones(1), "z": torch.ones(1)}),
            "unknown tensor 'z'",
        ),
        (ClientUpdate("x", 1, {"w": torch.ones(3), "b": torch.ones(1)}), "has shape (3,), expected (2,)"),
        (ClientUpdate("x", 1, {"w": torch.tensor([1.0, float("nan")]), "b": torch.ones(1)}), "non-finite"),
        (
            ClientUpdate("x", 0, {"w": torch.ones(2), "b": torch.ones(1)}),
            "n_samples must be a positive integer",
        ),
    ],
)
def test_bad_update_is_rejected_and_changes_nothing(bad, message):
    s = FedAvg()
    s.begin(GLOBAL)
    s.fold(UPDATES[0])
    with pytest.raises(StrategyError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        s.fold(bad)
    assert "\n" not in str(info.value)
    for u in UPDATES[1:]:
        s.fold(u)
    assert torch.equal(s.finish()["w"], torch.tensor([3.0, 3.0]))


def test_fold_before_begin_is_a_typed_error():
    with pytest.raises(StrategyError, match="before begin"):
        FedAvg().fold(UPDATES[0])


def test_half_precision_model_accumulates_in_float32_and_returns_half():
    glob = {"w": torch.zeros(2, dtype=torch.float16)}
    s = FedAvg()
    s.begin(glob)
    for i in range(3):
        s.fold(ClientUpdate(str(i), 1000, {"w": torch.full((2,), 1.0 + i, dtype=torch.float16)}))
    out = s.finish()["w"]
    assert out.dtype == torch.float16 and torch.equal(out, torch.tensor([2.0, 2.0], dtype=torch.float16))
