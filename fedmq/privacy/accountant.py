"""The privacy accountant: the client-level (ε, δ) a job has spent, from Google's dp-accounting library.

A job under DP makes releases: one per synchronous round, one per published asynchronous version. Each release
is modelled as a Poisson-subsampled Gaussian mechanism: every client takes part independently with probability
q (the sampling rate), its clipped update has sensitivity 1 in units of the clipping bound, and the sum is
noised with standard deviation z (the noise multiplier) in the same units. ε is for the add/remove-one-client
adjacency at the job's δ.

Library and method: dp-accounting's RDP accountant (``dp_accounting.rdp.RdpAccountant`` with its default
orders, composing ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` T times; Mironov et al. 2019, "Rényi
differential privacy of the sampled Gaussian mechanism"), converted to (ε, δ) by the library's conversion
(Canonne et al. 2020, Proposition 12; Asoodeh et al. 2020, equation 20). RDP rather than the library's PLD
accountant because T releases compose by a count at the cost of one (a PLD composes by convolutions of
discretised distributions) and its ε is an upper bound at any T; PLD would give a somewhat smaller ε. Where
the library's series for a fractional order does not converge it drops that order (a larger ε, still an upper
bound; its warning is not shown); this happens only at ε in the tens (tests/unit/test_privacy_accountant.py
compares every ε with an independent computation).

dp-accounting is imported on first use (it takes most of a second), so that the checks and defaults here
cost nothing to import.
"""

from __future__ import annotations

import functools
import logging
import math
import random
from collections.abc import Sequence
from typing import Any

from fedmq.errors import BadParameter

# noise_for_epsilon's largest z: the noise would be 10⁴ times the clipping bound, and past it dp-accounting's
# RDP terms approach rounding error (ε then reads 0 from a negative divergence)
MAX_NOISE_MULTIPLIER = 1e4
# noise_for_epsilon's tolerance on z: the z it returns is within this of the smallest z that meets the target
NOISE_TOLERANCE = 1e-4
# δ = 1 / K**DELTA_EXPONENT by default: below 1/K, the bound check_delta holds δ to
DELTA_EXPONENT = 1.1
_STATE_KEYS = ("sampling_rate", "noise_multiplier", "delta", "releases")


def check_sampling_rate(q: float) -> None:
    """Refuse a sampling rate outside (0, 1]."""
    if not _is_number(q) or not 0 < q <= 1:
        raise BadParameter(f"the sampling rate must be in (0, 1], got {q!r}")


def check_noise_multiplier(z: float) -> None:
    """Refuse a negative or non-finite noise multiplier (0 is allowed: no noise, ε = inf)."""
    if not _is_number(z) or not 0 <= z < math.inf:
        raise BadParameter(f"the noise multiplier must be a finite number ≥ 0, got {z!r}")


def check_delta(delta: float, clients: int) -> None:
    """Refuse δ ≤ 0 or δ ≥ 1/K for K clients: publishing each client's data whole with probability δ is
    (0, δ)-DP, so a δ of 1/K or more allows publishing one client's data on average."""
    _check_clients(clients)
    if not _is_number(delta) or not 0 < delta < 1 / clients:
        raise BadParameter(
            f"δ must be in (0, 1/K) = (0, {1 / clients:.3g}) for K = {clients} clients, got {delta!r}"
        )


def default_delta(clients: int) -> float:
    """δ = 1 / K**1.1 for K clients."""
    _check_clients(clients)
    return float(clients**-DELTA_EXPONENT)


def poisson_sample(rng: random.Random, clients: Sequence[str], rate: float) -> list[str]:
    """Poisson sampling, the sampling the accountant assumes: each client independently with probability
    ``rate``; the sample is sorted, and may be empty. Clients are drawn in sorted order (a name given twice
    counts once), so a seeded ``rng`` gives the same sample whatever the order of ``clients``. Services pass a
    ``random.SystemRandom``: a sample that can be predicted from a seed is not the secret sampling the
    accounting assumes."""
    check_sampling_rate(rate)
    return [client for client in sorted(set(clients)) if rng.random() < rate]


def update_noise_for_adaptive_clipping(noise_multiplier: float, count_stddev: float) -> float:
    """The noise multiplier z_Δ of the update sum when adaptive clipping also releases a noised clipped count.

    Andrew et al. 2021, "Differentially private learning with adaptive clipping" (NeurIPS), section 3: each
    client reports the bit b_i = [‖Δ_i‖ ≤ C] and the server releases Σ (b_i − 1/2) + N(0, σ_b²), a sum of
    sensitivity 1/2, i.e. a Gaussian mechanism of noise multiplier 2σ_b. Released beside the update sum with
    noise multiplier z_Δ, the pair is as private as one Gaussian mechanism with
    z = (z_Δ^-2 + (2σ_b)^-2)^(-1/2), so a job accounted at z noises its updates with
    z_Δ = (z^-2 − (2σ_b)^-2)^(-1/2). That needs 2σ_b > z; the paper suggests σ_b = (expected clients a
    round) / 20.
    """
    check_noise_multiplier(noise_multiplier)
    if noise_multiplier == 0:
        raise BadParameter("adaptive clipping needs noise: the noise multiplier must be > 0")
    if not _is_number(count_stddev) or not 2 * count_stddev > noise_multiplier:
        raise BadParameter(
            f"the clipped count's noise σ_b must exceed half the noise multiplier"
            f" ({noise_multiplier / 2:.4g}), got {count_stddev!r}"
        )
    return float((noise_multiplier**-2 - (2 * count_stddev) ** -2) ** -0.5)


def noise_for_epsilon(target_epsilon: float, delta: float, sampling_rate: float, releases: int) -> float:
    """The smallest noise multiplier z (to NOISE_TOLERANCE) whose ε after ``releases`` releases is at most
    ``target_epsilon``: dp-accounting's calibration (Brent's method on ε(z) in [0, MAX_NOISE_MULTIPLIER],
    falling back to bisection; the z it returns always meets the target). A target that z =
    MAX_NOISE_MULTIPLIER does not meet is refused."""
    if not _is_number(target_epsilon) or not 0 < target_epsilon < math.inf:
        raise BadParameter(f"the target ε must be a finite number > 0, got {target_epsilon!r}")
    _check_delta_range(delta)
    check_sampling_rate(sampling_rate)
    _check_releases(releases)
    dp_accounting = _library()
    from dp_accounting.rdp import RdpAccountant

    least = _epsilon(sampling_rate, MAX_NOISE_MULTIPLIER, delta, releases)
    if least > target_epsilon:
        raise BadParameter(
            f"ε = {target_epsilon} at δ = {delta} in {releases} releases is out of reach: even z ="
            f" {MAX_NOISE_MULTIPLIER:g} gives ε = {least:.4g}"
        )
    z = dp_accounting.calibrate_dp_mechanism(
        RdpAccountant,
        lambda z: dp_accounting.SelfComposedDpEvent(_release(sampling_rate, z), releases),
        target_epsilon,
        delta,
        dp_accounting.ExplicitBracketInterval(0.0, MAX_NOISE_MULTIPLIER),
        tol=NOISE_TOLERANCE,
    )
    return float(z)


class Accountant:
    """The client-level (ε, δ) of a job: one Poisson-subsampled Gaussian release per synchronous round or per
    published asynchronous version. z = 0 (no noise) gives ε = inf after any release."""

    def __init__(self, sampling_rate: float, noise_multiplier: float, delta: float) -> None:
        check_sampling_rate(sampling_rate)
        check_noise_multiplier(noise_multiplier)
        _check_delta_range(delta)
        self.sampling_rate = float(sampling_rate)
        self.noise_multiplier = float(noise_multiplier)
        self.delta = float(delta)
        self._releases = 0

    @property
    def releases(self) -> int:
        return self._releases

    def step(self, releases: int = 1) -> None:
        """Count ``releases`` more releases (0 is allowed and changes nothing)."""
        _check_releases(releases, least=0)
        self._releases += releases

    def epsilon(self) -> float:
        """ε after the releases so far (0.0 before the first)."""
        return self.epsilon_after(self._releases)

    def epsilon_after(self, releases: int) -> float:
        """ε had the job made ``releases`` releases (to stop before a release that would pass a target)."""
        _check_releases(releases, least=0)
        return _epsilon(self.sampling_rate, self.noise_multiplier, self.delta, releases)

    def state_dict(self) -> dict[str, float | int]:
        return {
            "sampling_rate": self.sampling_rate,
            "noise_multiplier": self.noise_multiplier,
            "delta": self.delta,
            "releases": self._releases,
        }

    def load_state_dict(self, state: Any) -> None:
        """Restore the count of releases from ``state_dict()``; a state of other settings or bad values is
        refused and changes nothing."""
        if not isinstance(state, dict) or set(state) != set(_STATE_KEYS):
            raise BadParameter(f"the accountant's state must have exactly the keys {', '.join(_STATE_KEYS)}")
        mine = self.state_dict()
        for key in ("sampling_rate", "noise_multiplier", "delta"):
            if not _is_number(state[key]) or float(state[key]) != mine[key]:
                raise BadParameter(
                    f"the accountant's state is for {key} = {state[key]!r}, this job's is {mine[key]!r}"
                )
        releases = state["releases"]
        if not isinstance(releases, int) or isinstance(releases, bool) or releases < 0:
            raise BadParameter(f"the accountant's state has a bad count of releases: {releases!r}")
        self._releases = releases


@functools.lru_cache(maxsize=1024)
def _epsilon(q: float, z: float, delta: float, releases: int) -> float:
    if releases == 0:
        return 0.0
    _library()
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant()
    accountant.compose(_release(q, z), releases)
    return float(accountant.get_epsilon(delta))


def _release(q: float, z: float) -> Any:
    dp_accounting = _library()
    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))


@functools.cache
def _library() -> Any:
    """dp-accounting, imported on first use, its warnings about orders it drops filtered out of the log."""
    import dp_accounting

    logging.getLogger("absl").addFilter(_drop_library_warnings)
    return dp_accounting


def _drop_library_warnings(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR or "dp_accounting" not in record.pathname


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and not math.isnan(x)


def _check_delta_range(delta: float) -> None:
    if not _is_number(delta) or not 0 < delta < 1:
        raise BadParameter(f"δ must be in (0, 1), got {delta!r}")


def _check_clients(clients: int) -> None:
    if not isinstance(clients, int) or isinstance(clients, bool) or clients < 1:
        raise BadParameter(f"the number of clients must be a whole number ≥ 1, got {clients!r}")


def _check_releases(releases: int, least: int = 1) -> None:
    if not isinstance(releases, int) or isinstance(releases, bool) or releases < least:
        raise BadParameter(f"the number of releases must be a whole number ≥ {least}, got {releases!r}")
