"""FedAtt: hand-worked attention, the two norms, seeded randomization, streaming == batch."""

from __future__ import annotations

import math
import random

import pytest
import torch

from fedmq.aggregator.strategies.base import ClientUpdate
from fedmq.aggregator.strategies.fedatt import FedAtt, tensor_distance
from fedmq.errors import BadParameter


def run(strategy, glob, updates):
    strategy.begin(glob)
    for u in updates:
        strategy.fold(u)
    return strategy.finish()


def test_equal_distances_give_equal_attention():
    # s_a = ‖[3,4]‖ = 5, s_b = ‖[0,5]‖ = 5 → α = (1/2, 1/2); θ' = 0 − 1.2·(0 − [1.5, 4.5]) = [1.8, 5.4]
    out = run(
        FedAtt(),
        {"w": torch.zeros(2)},
        [
            ClientUpdate("a", 1, {"w": torch.tensor([3.0, 4.0])}),
            ClientUpdate("b", 9, {"w": torch.tensor([0.0, 5.0])}),
        ],
    )
    torch.testing.assert_close(out["w"], torch.tensor([1.8, 5.4]))


def test_hand_worked_attention_prefers_the_farther_client():
    # s_a = 5, s_b = ‖[6,8]‖ = 10 → α_a = 1/(1+e^5) = 0.0066928509, α_b = 0.9933071491
    # θ' = 1.2·(α_a·[3,4] + α_b·[6,8]) = [7.1759057, 9.5678743]
    s = FedAtt()
    out = run(
        s,
        {"w": torch.zeros(2)},
        [
            ClientUpdate("a", 1, {"w": torch.tensor([3.0, 4.0])}),
            ClientUpdate("b", 1, {"w": torch.tensor([6.0, 8.0])}),
        ],
    )
    torch.testing.assert_close(out["w"], torch.tensor([7.1759057, 9.5678743]))
    w = s.client_weights()
    assert w["a"] == pytest.approx(0.0066928509) and w["b"] == pytest.approx(0.9933071491)


def test_fro_and_spectral_norms():
    a, b, zero = torch.diag(torch.tensor([3.0, 4.0])), torch.ones(2, 2), torch.zeros(2, 2)
    # diag(3,4): Frobenius 5, largest singular value 4; ones(2,2): rank one, both norms 2
    assert tensor_distance(zero, a, "fro") == pytest.approx(5.0)
    assert tensor_distance(zero, a, "spectral") == pytest.approx(4.0)
    assert tensor_distance(zero, b, "spectral") == pytest.approx(2.0)
    # 1-D tensors use the vector 2-norm under both
    assert tensor_distance(torch.zeros(2), torch.tensor([3.0, 4.0]), "spectral") == pytest.approx(5.0)
    ups = [ClientUpdate("a", 1, {"w": a}), ClientUpdate("b", 1, {"w": b})]
    fro = run(FedAtt(epsilon=1.0), {"w": zero}, ups)["w"]
    spec = run(FedAtt(epsilon=1.0, norm="spectral"), {"w": zero}, ups)["w"]
    # ε = 1: θ' = α_a·a + α_b·b; fro α_a = 1/(1+e^-3) = 0.9525741, spectral α_a = 1/(1+e^-2) = 0.8807971
    fa, sa = 0.9525741268, 0.8807970780
    torch.testing.assert_close(fro, fa * a + (1 - fa) * b)
    torch.testing.assert_close(spec, sa * a + (1 - sa) * b)
    assert fro[0, 0] == pytest.approx(3 * fa + (1 - fa))  # 2.9051483


def test_spectral_norm_of_a_4d_tensor_uses_shape0_by_rest():
    t = torch.arange(24.0).reshape(2, 3, 2, 2)
    expected = float(torch.linalg.matrix_norm(t.reshape(2, 12), ord=2))
    assert tensor_distance(torch.zeros_like(t), t, "spectral") == pytest.approx(expected)


def batch_fedatt(glob, updates, eps):
    """Reference: all distances at once, softmax, θ − ε Σ α_k (θ − θ_k)."""
    out = {}
    for name, g in glob.items():
        s = torch.tensor(
            [float(torch.dist(g.double(), u.tensors[name].double())) for u in updates], dtype=torch.float64
        )
        alpha = torch.softmax(s, 0)
        out[name] = g.double() - eps * sum(
            a * (g.double() - u.tensors[name].double()) for a, u in zip(alpha, updates)
        )
    return out


def test_streaming_equals_batch_in_any_order():
    gen = torch.Generator().manual_seed(3)
    glob = {"e": torch.randn(30, 4, generator=gen), "b": torch.randn(4, generator=gen)}
    # distances differ by tens: the running max changes mid-stream and the rescaling is exercised
    ups = [
        ClientUpdate(
            str(i), 1, {k: v + (i + 1) * torch.randn(v.shape, generator=gen) for k, v in glob.items()}
        )
        for i in range(6)
    ]
    ref = batch_fedatt(glob, ups, 1.2)
    orders = [ups, ups[::-1]] + [random.Random(i).sample(ups, len(ups)) for i in range(3)]
    for order in orders:
        out = run(FedAtt(), glob, order)
        for k in glob:
            torch.testing.assert_close(out[k].double(), ref[k], rtol=1e-5, atol=1e-5)


def test_large_distances_do_not_overflow():
    glob = {"w": torch.zeros(2)}
    ups = [
        ClientUpdate("a", 1, {"w": torch.tensor([1000.0, 0.0])}),
        ClientUpdate("b", 1, {"w": torch.tensor([0.0, 2000.0])}),
    ]
    out = run(FedAtt(epsilon=1.0), glob, ups)["w"]  # e^1000 overflows a naive softmax; α_b = 1
    torch.testing.assert_close(out, torch.tensor([0.0, 2000.0]))


@pytest.mark.parametrize(
    "params", [{"epsilon": 0}, {"epsilon": float("nan")}, {"norm": "l1"}, {"norm": None}]
)
def test_bad_parameters(params):
    with pytest.raises(BadParameter):
        FedAtt(**params)


def test_chunked_distance_matches_torch_dist_on_large_tensors():
    from fedmq.aggregator.strategies._common import sq_distance

    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(700_001, generator=gen), torch.randn(700_001, generator=gen)  # several chunks + a tail
    assert math.sqrt(sq_distance(a, b)) == pytest.approx(float(torch.dist(a.double(), b.double())), rel=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_update_is_rejected_and_changes_nothing(bad):
    from fedmq.aggregator.strategies.fedmed import FedMed, FedMedRelative, FedMedStandardised
    from fedmq.errors import StrategyError

    good = ClientUpdate("a", 1, {"w": torch.tensor([3.0, 4.0])})
    for make in (FedAtt, FedMed, FedMedRelative, FedMedStandardised):
        strategy = make()
        strategy.begin({"w": torch.zeros(2)})
        strategy.fold(good)
        with pytest.raises(StrategyError, match="non-finite"):
            strategy.fold(ClientUpdate("x", 1, {"w": torch.tensor([bad, 0.0])}))
        # FedMed's variants weigh JS over the round: refold what was kept
        extra = strategy.second_pass(frozenset({"x"}))
        if extra is not None:
            strategy = make(**extra)
            strategy.begin({"w": torch.zeros(2)})
            strategy.fold(good)
        out = strategy.finish()["w"]
        assert torch.isfinite(out).all() and strategy.client_weights().keys() == {"a"}
