"""FedMed's adaptive aggregation: the name ``fedmed`` is the paper's formula (hand-worked, and against an
independent numpy computation of Eqs. (2), (3), (5)); its variants ``fedmed-relative`` and
``fedmed-standardised`` (two passes) are reached by their own names."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedmq.aggregator.strategies.base import ClientUpdate, aggregate
from fedmq.aggregator.strategies.fedmed import FedMed, FedMedRelative, FedMedStandardised, js_divergence
from fedmq.aggregator.strategies.registry import make_strategy, strategy_class
from fedmq.errors import BadParameter, StrategyError

LN3 = math.log(3.0)


def run(strategy, glob, updates):
    strategy.begin(glob)
    for u in updates:
        strategy.fold(u)
    return strategy.finish()


def test_js_divergence_hand_worked():
    # p = softmax([0,0]) = [1/2, 1/2]; q = softmax([ln 3, 0]) = [3/4, 1/4]; m = [5/8, 3/8]
    # KL(p‖m) = ½ln(0.8) + ½ln(4/3) = 0.0322693; KL(q‖m) = ¾ln(1.2) + ¼ln(2/3) = 0.0353749
    # JS = ½(0.0322693 + 0.0353749) = 0.0338221
    assert js_divergence(torch.zeros(2), torch.tensor([LN3, 0.0])) == pytest.approx(0.0338221, abs=1e-6)
    assert js_divergence(torch.zeros(5), torch.zeros(5)) == 0.0
    # bounded by ln 2 for disjoint-looking distributions
    assert js_divergence(torch.tensor([100.0, 0.0]), torch.tensor([0.0, 100.0])) == pytest.approx(
        math.log(2), abs=1e-9
    )


def test_chunked_js_matches_direct_formula_on_a_large_tensor():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3_000_000, generator=gen), torch.randn(3_000_000, generator=gen)  # > one 1M chunk
    lp, lq = F.log_softmax(a.double(), 0), F.log_softmax(b.double(), 0)
    lm = torch.logaddexp(lp, lq) - math.log(2)
    ref = 0.5 * float((lp.exp() * (lp - lm)).sum() + (lq.exp() * (lq - lm)).sum())
    assert js_divergence(a, b) == pytest.approx(ref, rel=1e-9)


def test_adaptive_hand_worked():  # the paper's literal γ = softmax(JS)
    # client a equals the global model: JS_a = 0; client b: JS_b = 0.0338221 (above)
    # γ_b = 1/(1 + e^-0.0338221) = 0.5084547, γ_a = 0.4915453; η = 1:
    # θ' = γ_a·[0,0] + γ_b·[ln3, 0] = [0.5585946, 0]
    s = FedMed()
    out = run(
        s,
        {"w": torch.zeros(2)},
        [ClientUpdate("a", 5, {"w": torch.zeros(2)}), ClientUpdate("b", 1, {"w": torch.tensor([LN3, 0.0])})],
    )
    torch.testing.assert_close(out["w"], torch.tensor([0.5585946, 0.0]))
    assert s.client_weights()["b"] == pytest.approx(0.5084547, abs=1e-6)


def test_eta_scales_the_step():
    # η = 0.5: θ' = θ − ½ Σ γ_k (θ − θ_k) = ½·[0.5585946, 0]
    out = run(
        FedMed(eta=0.5),
        {"w": torch.zeros(2)},
        [ClientUpdate("a", 1, {"w": torch.zeros(2)}), ClientUpdate("b", 1, {"w": torch.tensor([LN3, 0.0])})],
    )
    torch.testing.assert_close(out["w"], torch.tensor([0.2792973, 0.0]))


def test_streaming_equals_batch_in_any_order():
    gen = torch.Generator().manual_seed(1)
    glob = {"w": torch.randn(20, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    ups = [
        ClientUpdate(str(i), 1, {k: v + 2 * torch.randn(v.shape, generator=gen) for k, v in glob.items()})
        for i in range(5)
    ]
    ref = {}
    for k, g in glob.items():
        gamma = torch.softmax(
            torch.tensor([js_divergence(g, u.tensors[k]) for u in ups], dtype=torch.float64), 0
        )
        ref[k] = sum(float(c) * u.tensors[k].double() for c, u in zip(gamma, ups))
    for order in (ups, ups[::-1], ups[2:] + ups[:2]):
        out = run(FedMed(), glob, order)
        for k in glob:
            torch.testing.assert_close(out[k].double(), ref[k], rtol=1e-5, atol=1e-6)


VARIANTS = {"standardised": FedMedStandardised, "relative": FedMedRelative}


def _two_pass(glob, updates, js):
    cls = VARIANTS[js]
    first = cls()
    first.begin(glob)
    for u in updates:
        first.fold(u)
    with pytest.raises(StrategyError, match="second pass"):
        first.finish()
    out, second = aggregate(lambda **extra: cls(**extra), glob, updates)
    assert second.temperatures == first.second_pass()["temperatures"]
    return out, second


def test_standardised_js_is_a_softmax_of_z_scores_over_two_passes():
    glob = {"w": torch.zeros(2)}
    xs = [torch.zeros(2), torch.tensor([LN3, 0.0]), torch.tensor([2.0, -1.0])]
    ups = [ClientUpdate(c, 1, {"w": x}) for c, x in zip("abc", xs)]
    d = torch.tensor([js_divergence(glob["w"], x) for x in xs], dtype=torch.float64)
    gamma = torch.softmax((d - d.mean()) / d.std(unbiased=False), 0)
    out, s = _two_pass(glob, ups, js="standardised")
    torch.testing.assert_close(
        out["w"].double(), sum(g * x.double() for g, x in zip(gamma, xs)), rtol=1e-6, atol=1e-7
    )
    assert s.client_weights() == pytest.approx(dict(zip("abc", gamma.tolist())), abs=1e-9)
    # one pass is enough for the raw formula and for FedAvg mode
    raw = FedMed()
    raw.begin(glob)
    assert raw.second_pass() is None
    # equal divergences (or one client): equal weights, no division by zero
    same, s = _two_pass(
        glob, [ClientUpdate("a", 1, {"w": xs[1]}), ClientUpdate("b", 1, {"w": xs[1]})], js="standardised"
    )
    assert s.client_weights() == {"a": 0.5, "b": 0.5}


def test_standardised_weights_differ_between_clients_on_real_updates():
    """The paper's literal softmax of raw JS gives near-uniform weights on trained models (JS ~1e-6 nats); the
    standardised weights differ between clients."""
    from fedmq.tasks.base import TrainConfig, model_state
    from fedmq.tasks.lm import LanguageModelTask

    task = LanguageModelTask(
        clients=4,
        seed=0,
        data="builtin",
        model="gru-small",
        emb=16,
        hidden=16,
        vocab_size=500,
        max_lines=600,
        max_eval_lines=50,
        bptt=10,
        dropout=0.0,
    )
    torch.manual_seed(0)
    glob = {k: v.clone() for k, v in model_state(task.build_model(0)).items()}
    ups = []
    for c in range(4):
        m = task.build_model(0)
        task.train(m, c, TrainConfig(batch_size=4, lr=5.0, max_steps=5, seed=c))
        ups.append(ClientUpdate(f"agent-{c}", 1, {k: v.clone() for k, v in model_state(m).items()}))
    raw = FedMed()
    run(raw, glob, ups)
    w_raw = raw.client_weights()
    assert max(w_raw.values()) / min(w_raw.values()) < 1.01  # inert: the finding
    _, std = _two_pass(glob, ups, js="standardised")
    w_std = std.client_weights()
    assert max(w_std.values()) / min(w_std.values()) > 1.5, w_std
    assert sum(w_std.values()) == pytest.approx(1.0)
    _, rel = _two_pass(glob, ups, js="relative")
    w_rel = rel.client_weights()
    assert 1.1 < max(w_rel.values()) / min(w_rel.values()) < max(w_std.values()) / min(w_std.values()), w_rel
    assert sum(w_rel.values()) == pytest.approx(1.0)


def test_relative_js_divides_by_the_rounds_mean_and_is_not_degenerate_at_two_clients():
    glob = {"w": torch.zeros(2)}
    xs = [torch.zeros(2) + 0.1, torch.tensor([LN3, 0.0]), torch.tensor([2.0, -1.0])]
    ups = [ClientUpdate(c, 1, {"w": x}) for c, x in zip("abc", xs)]
    d = torch.tensor([js_divergence(glob["w"], x) for x in xs], dtype=torch.float64)
    gamma = torch.softmax(d / d.mean(), 0)
    out, s = _two_pass(glob, ups, js="relative")
    torch.testing.assert_close(
        out["w"].double(), sum(g * x.double() for g, x in zip(gamma, xs)), rtol=1e-6, atol=1e-7
    )
    assert s.client_weights() == pytest.approx(dict(zip("abc", gamma.tolist())), abs=1e-9)
    # two clients: standardised weights are 0.881 / 0.119 whether the divergences are close or far apart;
    # relative ones follow the ratio, and equal divergences give equal weights
    near = [
        ClientUpdate("a", 1, {"w": torch.tensor([1.0, 0.0])}),
        ClientUpdate("b", 1, {"w": torch.tensor([1.01, 0.0])}),
    ]
    far = [
        ClientUpdate("a", 1, {"w": torch.tensor([1.0, 0.0])}),
        ClientUpdate("b", 1, {"w": torch.tensor([3.0, 0.0])}),
    ]
    for pair in (near, far):
        _, std = _two_pass(glob, pair, js="standardised")
        assert sorted(std.client_weights().values()) == pytest.approx([0.1192, 0.8808], abs=1e-4)
    _, rel_near = _two_pass(glob, near, js="relative")
    _, rel_far = _two_pass(glob, far, js="relative")
    assert 0.5 < rel_near.client_weights()["b"] < 0.51
    assert rel_far.client_weights()["b"] > 0.7
    _, same = _two_pass(glob, [near[0], ClientUpdate("b", 1, {"w": torch.tensor([1.0, 0.0])})], js="relative")
    assert same.client_weights() == pytest.approx({"a": 0.5, "b": 0.5})


# ------------------------------------------------------------------------------- the paper's formula, by name
def _softmax(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max())
    return e / e.sum()


def _paper_fedmed(glob: dict, clients: list[dict], eta: float = 1.0) -> tuple[dict, dict]:
    """FedMed §3.2 in numpy: per layer l, d_k = JS(w^l ‖ w_k^l) = KL(w ‖ (w + w_k)/2)/2
    + KL(w_k ‖ (w + w_k)/2)/2 (Eq. 2) of the layers' softmax distributions, γ_k = e^{d_k} / Σ_k e^{d_k}
    (Eq. 3), and w ← w − η Σ_k γ_k (w − w_k) (Eq. 5). Returns the new layers and each layer's γ."""
    out, gammas = {}, {}
    for name, g in glob.items():
        w = np.asarray(g, dtype=np.float64)
        p = _softmax(w.ravel())
        d = []
        for c in clients:
            q = _softmax(np.asarray(c[name], dtype=np.float64).ravel())
            m = (p + q) / 2
            d.append(np.sum(p * np.log(p / m)) / 2 + np.sum(q * np.log(q / m)) / 2)
        gamma = np.exp(d) / np.sum(np.exp(d))
        out[name] = w - eta * sum(
            gk * (w - np.asarray(c[name], dtype=np.float64)) for gk, c in zip(gamma, clients)
        )
        gammas[name] = gamma
    return out, gammas


def _three_updates():
    glob = {"w": np.zeros((2, 3)), "b": np.array([0.0, 0.0])}
    clients = [
        {"w": np.array([[6.0, 0.0, 0.0], [0.0, 0.0, 0.0]]), "b": np.array([0.5, -0.4])},
        {"w": np.array([[0.2, 0.1, 0.0], [0.0, -0.1, 0.0]]), "b": np.array([6.0, -6.0])},
        {"w": np.array([[-1.0, 2.0, -3.0], [1.0, 0.5, 0.0]]), "b": np.array([0.1, 0.0])},
    ]
    return glob, clients


def _torch(state: dict) -> dict:
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in state.items()}


def test_the_name_fedmed_is_the_papers_formula_against_numpy():
    from fedmq.aggregator.config import JobConfig
    from fedmq.aggregator.strategies.registry import strategy_from_config

    glob, clients = _three_updates()
    ref, gammas = _paper_fedmed(glob, clients, eta=0.7)
    # the reference is not an unweighted mean: the formula's weights matter on these updates
    assert all(g.max() / g.min() > 1.15 for g in gammas.values()), gammas
    ups = [ClientUpdate(f"c{i}", 1 + i, _torch(c)) for i, c in enumerate(clients)]
    # by name from Python, and as a job builds it (the job's other settings do not change it)
    _, job = strategy_from_config("fedmed", JobConfig(strategy="fedmed", strategy_args={"eta": 0.7}))
    for s in (make_strategy("fedmed", eta=0.7), job):
        assert type(s) is FedMed and s.second_pass() is None  # one pass: no temperature
        out = run(s, _torch(glob), ups)
        for name in glob:
            np.testing.assert_allclose(out[name].double().numpy(), ref[name], rtol=1e-5, atol=1e-6)
    # the variants give other weights on the same round
    for variant in ("fedmed-relative", "fedmed-standardised"):
        other, _ = aggregate(partial(make_strategy, variant, eta=0.7), _torch(glob), ups)
        assert max(float(np.abs(other[n].double().numpy() - ref[n]).max()) for n in glob) > 1e-2, variant


def test_each_weighting_has_its_own_name_and_no_js_knob():
    assert strategy_class("fedmed") is FedMed and FedMed.js == "raw"
    assert strategy_class("fedmed-relative") is FedMedRelative and FedMedRelative.js == "relative"
    assert (
        strategy_class("fedmed-standardised") is FedMedStandardised
        and FedMedStandardised.js == "standardised"
    )
    for name in ("fedmed", "fedmed-relative", "fedmed-standardised"):
        cls = strategy_class(name)
        assert issubclass(cls, FedMed) and cls.plan == FedMed.plan
        with pytest.raises(BadParameter, match="has no parameter 'js'"):
            make_strategy(name, js="raw")
