"""The privacy accountant (fedmq/privacy/accountant.py): its ε against an independent computation of the
Poisson-subsampled Gaussian's RDP, its state, its refusals, the noise it calibrates and Poisson sampling."""

from __future__ import annotations

import functools
import json
import math
import random

import numpy as np
import pytest
from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS
from scipy import integrate, special

from fedmq.errors import BadParameter
from fedmq.privacy.accountant import (
    NOISE_TOLERANCE,
    Accountant,
    check_delta,
    default_delta,
    noise_for_epsilon,
    poisson_sample,
    update_noise_for_adaptive_clipping,
)

DELTA = 1e-5
# below this ε the accountant must equal the independent computation; above it (only q = 0.1, z = 0.5 in the
# grid: ε ≈ 37 and 236) dp-accounting drops fractional orders whose series does not converge, and its ε is
# only checked to be no smaller
EXACT_UP_TO = 16.0


def log_a_integer(q: float, sigma: float, alpha: int) -> float:
    """log A_α at integer α (Mironov et al. 2019, "Rényi differential privacy of the sampled Gaussian
    mechanism", section 3.3): A_α = Σ_{k=0..α} C(α,k) (1−q)^(α−k) q^k exp((k²−k)/(2σ²))."""
    k = np.arange(alpha + 1, dtype=np.float64)
    log_terms = (
        special.gammaln(alpha + 1)
        - special.gammaln(k + 1)
        - special.gammaln(alpha - k + 1)
        + special.xlogy(k, q)
        + special.xlogy(alpha - k, 1 - q)
        + (k * k - k) / (2 * sigma**2)
    )
    return float(special.logsumexp(log_terms))


def log_a_fractional(q: float, sigma: float, alpha: float) -> float:
    """log A_α at any α > 1 from its definition, A_α = E_{x~N(0,σ²)}[(1 + r(x))^α] with
    r = q (exp((2x−1)/(2σ²)) − 1), by numerical integration. E[r] = 0, so A_α − 1 = E[(1 + r)^α − 1 − α r], an
    integrand ≥ 0 (no cancellation) of order q², which keeps the precision at small q."""

    def integrand(x: float) -> float:
        shift = (2 * x - 1) / (2 * sigma**2)  # log of the two Gaussians' density ratio at x
        log_pdf = -x * x / (2 * sigma**2) - math.log(sigma * math.sqrt(2 * math.pi))
        r = q * math.expm1(shift)
        u = alpha * (shift if q == 1 else math.log1p(r))
        if u < 1:
            return (math.expm1(u) - alpha * r) * math.exp(log_pdf)
        return (
            math.exp(u + log_pdf)
            - math.exp(log_pdf)
            - alpha * q * (math.exp(shift + log_pdf) - math.exp(log_pdf))
        )

    value, _ = integrate.quad(
        integrand,
        -40 * sigma,
        alpha + 40 * sigma,
        points=[0.0, 0.5, 1.0, alpha],
        limit=500,
        epsabs=0,
        epsrel=1e-10,
    )
    return math.log1p(value)


@functools.cache
def reference_rdp(q: float, sigma: float) -> list[float]:
    """One release's RDP at each order dp-accounting's RdpAccountant uses (its default set)."""
    return [
        (log_a_integer(q, sigma, int(a)) if float(a).is_integer() else log_a_fractional(q, sigma, a))
        / (a - 1)
        for a in DEFAULT_RDP_ORDERS
    ]


def reference_epsilon(q: float, sigma: float, releases: int, delta: float) -> float:
    """ε of ``releases`` releases at ``delta``, written without dp-accounting: RDP sums over releases, then
    ε = min_α ε_T(α) + log(1 − 1/α) − log(δα)/(α − 1) (Canonne et al. 2020, Proposition 12), and ε = 0 at an
    order where δ ≥ sqrt(1 − exp(−ε_T(α))): the conversion dp-accounting applies."""
    eps = []
    for alpha, rdp in zip(DEFAULT_RDP_ORDERS, reference_rdp(q, sigma)):
        total = releases * rdp
        if delta**2 + math.expm1(-total) > 0:
            eps.append(0.0)
        else:
            eps.append(total + math.log1p(-1 / alpha) - math.log(delta * alpha) / (alpha - 1))
    return max(0.0, min(eps))


@pytest.mark.parametrize("q", [0.001, 0.01, 0.1, 1.0])
@pytest.mark.parametrize("z", [0.5, 1.0, 2.0, 5.0])
def test_epsilon_equals_an_independent_rdp_computation(q: float, z: float):
    accountant = Accountant(q, z, DELTA)
    for releases in (1, 10, 100, 1000):
        expected = reference_epsilon(q, z, releases, DELTA)
        got = accountant.epsilon_after(releases)
        assert got >= expected * (1 - 1e-9)
        if expected <= EXACT_UP_TO:
            assert got == pytest.approx(expected, rel=1e-3, abs=1e-12)


def test_epsilon_grows_with_releases_and_steps_count_them():
    accountant = Accountant(0.01, 1.0, DELTA)
    assert accountant.releases == 0 and accountant.epsilon() == 0.0
    seen = [accountant.epsilon()]
    for step in (1, 1, 3, 0, 20, 100, 1000):
        accountant.step(step)
        seen.append(accountant.epsilon())
    assert accountant.releases == 1125
    assert seen == sorted(seen) and seen[-1] > seen[1] > 0
    assert accountant.epsilon() == accountant.epsilon_after(1125)
    assert accountant.epsilon_after(1126) >= accountant.epsilon()


def test_without_noise_epsilon_is_infinite_after_one_release():
    accountant = Accountant(0.1, 0.0, DELTA)
    assert accountant.epsilon() == 0.0
    accountant.step()
    assert accountant.epsilon() == math.inf


def test_state_round_trip_gives_the_same_epsilon():
    accountant = Accountant(0.01, 1.3, DELTA)
    accountant.step(57)
    state = json.loads(json.dumps(accountant.state_dict()))
    restored = Accountant(0.01, 1.3, DELTA)
    restored.load_state_dict(state)
    assert restored.releases == 57
    assert restored.epsilon() == accountant.epsilon()
    assert restored.state_dict() == accountant.state_dict()


@pytest.mark.parametrize(
    "change",
    [
        {"sampling_rate": 0.02},
        {"noise_multiplier": 1.4},
        {"delta": 1e-6},
        {"releases": -1},
        {"releases": 1.5},
        {"releases": True},
        {"releases": "3"},
        {"delta": "1e-5"},
        {"extra": 1},
    ],
)
def test_load_state_dict_refuses_other_settings_and_bad_values(change: dict):
    accountant = Accountant(0.01, 1.3, DELTA)
    accountant.step(4)
    state = {**accountant.state_dict(), **change}
    with pytest.raises(BadParameter) as refused:
        accountant.load_state_dict(state)
    assert "\n" not in str(refused.value)
    assert accountant.releases == 4


@pytest.mark.parametrize("state", [None, [], {"releases": 3}, {1: 2, "releases": 3}])
def test_load_state_dict_refuses_what_is_not_a_state(state):
    accountant = Accountant(0.01, 1.3, DELTA)
    with pytest.raises(BadParameter):
        accountant.load_state_dict(state)
    assert accountant.releases == 0


@pytest.mark.parametrize(
    "target, delta, q, releases",
    [(2.0, 1e-4, 0.01, 1000), (8.0, 10_000**-1.1, 0.01, 500), (0.5, DELTA, 1.0, 1)],
)
def test_noise_for_epsilon_meets_the_target_and_no_less_noise_would(target, delta, q, releases):
    z = noise_for_epsilon(target, delta, q, releases)
    assert Accountant(q, z, delta).epsilon_after(releases) <= target
    assert Accountant(q, z - 2 * NOISE_TOLERANCE, delta).epsilon_after(releases) > target


@pytest.mark.parametrize(
    "target, delta, q, releases",
    [
        (0.0, DELTA, 0.1, 10),  # E ≤ 0
        (-1.0, DELTA, 0.1, 10),
        (math.inf, DELTA, 0.1, 10),
        (1.0, 0.0, 0.1, 10),
        (1.0, DELTA, 0.0, 10),
        (1.0, DELTA, 0.1, 0),
        (0.1, 1e-300, 0.5, 10),  # out of reach: RDP at order ≤ 1024 cannot reach it at this δ
    ],
)
def test_noise_for_epsilon_refuses_in_one_line(target, delta, q, releases):
    with pytest.raises(BadParameter) as refused:
        noise_for_epsilon(target, delta, q, releases)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "q, z, delta",
    [
        (0.0, 1.0, DELTA),  # q ≤ 0
        (-0.1, 1.0, DELTA),
        (1.5, 1.0, DELTA),
        (float("nan"), 1.0, DELTA),
        (0.1, -0.5, DELTA),  # z < 0
        (0.1, math.inf, DELTA),
        (0.1, 1.0, 0.0),
        (0.1, 1.0, 1.0),
        (0.1, True, DELTA),
    ],
)
def test_accountant_refuses_bad_settings_in_one_line(q, z, delta):
    with pytest.raises(BadParameter) as refused:
        Accountant(q, z, delta)
    assert "\n" not in str(refused.value)


def test_steps_and_release_counts_are_checked():
    accountant = Accountant(0.1, 1.0, DELTA)
    for bad in (-1, 1.0, True):
        with pytest.raises(BadParameter):
            accountant.step(bad)
        with pytest.raises(BadParameter):
            accountant.epsilon_after(bad)
    assert accountant.releases == 0


def test_delta_default_and_its_bound():
    assert default_delta(10_000) == pytest.approx(10_000**-1.1)
    assert default_delta(10_000) < 1 / 10_000
    check_delta(default_delta(10_000), 10_000)
    for delta, clients in ((1e-4, 10_000), (0.2, 10), (0.0, 10), (-1e-9, 10), (1e-6, 0)):  # δ ≥ 1/K, δ ≤ 0
        with pytest.raises(BadParameter) as refused:
            check_delta(delta, clients)
        assert "\n" not in str(refused.value)
    with pytest.raises(BadParameter):
        default_delta(0)


def test_adaptive_clipping_noise_split_composes_back_to_the_accounted_noise():
    z, sigma_b = 1.0, 5.0
    z_update = update_noise_for_adaptive_clipping(z, sigma_b)
    assert z_update > z
    assert (z_update**-2 + (2 * sigma_b) ** -2) ** -0.5 == pytest.approx(z)
    for bad_sigma in (0.5, 0.4, 0.0, -1.0):  # σ_b ≤ z/2 leaves no noise for the update
        with pytest.raises(BadParameter):
            update_noise_for_adaptive_clipping(z, bad_sigma)
    with pytest.raises(BadParameter):
        update_noise_for_adaptive_clipping(0.0, sigma_b)


def test_poisson_sample_takes_each_client_with_the_rate():
    clients = [f"c{i:04d}" for i in range(1000)]
    rate = 0.05
    counts = []
    for seed in range(200):
        sample = poisson_sample(random.Random(seed), clients, rate)
        assert sample == sorted(sample) and set(sample) <= set(clients)
        counts.append(len(sample))
    # 200 samples of Binomial(1000, 0.05): mean 50, the mean's standard deviation about 0.5
    assert 47 < sum(counts) / len(counts) < 53
    assert len(set(counts)) > 5  # the size of a sample varies: each client is drawn on its own


def test_poisson_sample_is_deterministic_for_a_seed_whatever_the_order():
    clients = [f"c{i:03d}" for i in range(300)]
    first = poisson_sample(random.Random(7), clients, 0.1)
    assert poisson_sample(random.Random(7), list(reversed(clients)), 0.1) == first
    assert poisson_sample(random.Random(8), clients, 0.1) != first
    assert poisson_sample(random.Random(7), clients, 1.0) == sorted(clients)
    for bad in (0.0, 1.01, -0.1):
        with pytest.raises(BadParameter):
            poisson_sample(random.Random(7), clients, bad)
