"""SecAgg+'s communication graph over a cohort: who masks with whom and who holds whose shares.

Bell et al. 2020 (CCS, "Secure single-server aggregation with (poly)logarithmic overhead") replace the
complete graph of Bonawitz et al. 2017 by a random k-regular graph: a client agrees keys, masks and shares its
secrets (t-of-k) with its k neighbours only. Their graph is a Harary graph H(n, k) (the n clients on a ring,
each joined to the k/2 nearest on either side) whose positions are a random permutation of the cohort. Here
the permutation comes from a seed the server draws and announces with the roster: each member's place on the
ring is the order of SHA-256(seed ‖ name), so every party derives the same graph from (seed, cohort).

Choosing k and t (``plan``) follows the paper's conditions for the semi-honest protocol, which the same
authors' open-source implementation (Google's federated-compute, `graph_parameter_finder.cc`) searches the
same way: for n clients of which at most γn are corrupted (they share everything with the server) and at
most δn drop out, with statistical security σ = 40 and correctness η = 20, take the smallest even k such that

1. the honest survivors stay connected: a Harary graph falls apart only if k consecutive clients on the ring
   are bad in two places, so n(n - k - 1)/2 · (B)_k / (n)_k < 2^-(σ+1), with B = ⌊γn⌋ + ⌊δn⌋ bad clients
   and (x)_k the falling factorial (a union bound; nothing to bound when k > B);
2. t = max(2, the smallest t with P[A ≥ t] ≤ 2^-(σ+1) / n): A, a client's corrupted neighbours, is
   hypergeometric (k draws from the n - 1 others, ⌊γn⌋ of them corrupted), so no client's corrupted
   neighbours reach t, the number that could rebuild its secrets, except with that probability;
3. P[S < t] ≤ 2^-η / n: S, a client's surviving neighbours (k draws, n - 1 - ⌊δn⌋ survivors among the
   others), so every secret the server needs can be rebuilt.

When no k < n - 1 meets them (small cohorts), the graph is complete (k = n - 1, the protocol of Bonawitz et
al.) with the exact conditions t > ⌊γn⌋ and t ≤ n - 1 - ⌊δn⌋; a cohort that cannot meet even those is
refused.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from fedmq.errors import SecAggError

SECURITY_BITS = 40  # σ: a client's input is exposed with probability below 2^-σ
CORRECTNESS_BITS = 20  # η: a round fails for want of shares with probability below 2^-η
SEED_BYTES = 32


@dataclass(frozen=True)
class GraphParams:
    degree: int  # k: neighbours of each client
    threshold: int  # t: shares that rebuild a client's secret


def _hypergeom_tail(population: int, marked: int, draws: int, at_least: int) -> float:
    """P[X ≥ at_least] for X the marked items among ``draws`` drawn without replacement (exact)."""
    total = math.comb(population, draws)
    top = min(marked, draws)
    hits = sum(
        math.comb(marked, i) * math.comb(population - marked, draws - i) for i in range(at_least, top + 1)
    )
    return hits / total


def _all_bad(bad: int, n: int, k: int) -> float:
    """(B)_k / (n)_k: the probability that k given clients are all among B bad ones of n."""
    return math.prod((bad - i) / (n - i) for i in range(k)) if k <= bad else 0.0


def _harary_ok(n: int, k: int, corrupt: int, dropped: int) -> GraphParams | None:
    bad = corrupt + dropped
    if k <= bad:
        pairs = n * (n - k - 1) / 2
        if pairs * _all_bad(bad, n, k) >= 2.0 ** -(SECURITY_BITS + 1):
            return None
    others = n - 1
    t = next(
        t
        for t in range(1, k + 2)
        if _hypergeom_tail(others, corrupt, k, t) <= 2.0 ** -(SECURITY_BITS + 1) / n
    )
    t = max(t, 2)
    survivors = others - dropped
    if t > k or 1 - _hypergeom_tail(others, survivors, k, t) > 2.0**-CORRECTNESS_BITS / n:
        return None
    return GraphParams(degree=k, threshold=t)


MIN_COHORT = 3  # a sum of two inputs tells each of them the other's


def plan(n: int, corrupt_fraction: float, dropout_fraction: float) -> GraphParams:
    """k and t for a cohort of n, of which γ = corrupt_fraction may collude with the server and
    δ = dropout_fraction may drop out (module docstring: the conditions and their source)."""
    if n < MIN_COHORT:
        raise SecAggError(
            "bad-parameter", f"a cohort of {n} cannot hide one input in a sum: {MIN_COHORT} or more"
        )
    for name, value in (("corrupt", corrupt_fraction), ("dropout", dropout_fraction)):
        if not 0.0 <= value < 1.0:
            raise SecAggError("bad-parameter", f"the {name} fraction is within [0, 1), not {value}")
    why = intolerable(n, corrupt_fraction, dropout_fraction)
    if why is not None:
        raise SecAggError("bad-parameter", why)
    corrupt, dropped = math.floor(corrupt_fraction * n), math.floor(dropout_fraction * n)
    for k in range(2, n - 1, 2):
        found = _harary_ok(n, k, corrupt, dropped)
        if found:
            return found
    return GraphParams(degree=n - 1, threshold=max(corrupt + 1, 2))


def intolerable(n: int, corrupt_fraction: float, dropout_fraction: float) -> str | None:
    """Why even the complete graph on n cannot hold (a threshold above the colluders and within the
    survivors), or None: ``plan`` then finds a graph. Only small cohorts can fail, below 2 / (1 − γ − δ)."""
    corrupt, dropped = math.floor(corrupt_fraction * n), math.floor(dropout_fraction * n)
    if max(corrupt + 1, 2) > n - 1 - dropped:
        return (
            f"a cohort of {n} cannot tolerate {corrupt} corrupted and {dropped} dropped clients "
            f"(it needs t > {corrupt} and t ≤ {n - 1 - dropped})"
        )
    return None


@dataclass(frozen=True)
class Cohort:
    """The members of one round or buffer, their graph and the threshold; the same on every party."""

    members: tuple[str, ...]  # sorted
    params: GraphParams
    seed: bytes
    _adjacent: dict[str, tuple[str, ...]] = field(repr=False, compare=False, default_factory=dict)

    @classmethod
    def build(cls, members: Sequence[str], params: GraphParams, seed: bytes) -> Cohort:
        names = tuple(sorted(members))
        n, k = len(names), params.degree
        if len(set(names)) != n or not all(names):
            raise SecAggError("bad-parameter", "a cohort's members are distinct, non-empty names")
        if len(seed) != SEED_BYTES:
            raise SecAggError("bad-parameter", f"a graph seed is {SEED_BYTES} bytes, got {len(seed)}")
        if not (k == n - 1 or (k % 2 == 0 and 2 <= k < n - 1)) or not 1 <= params.threshold <= k:
            raise SecAggError("bad-parameter", f"degree {k}, threshold {params.threshold} for {n} members")
        ring = sorted(names, key=lambda u: hashlib.sha256(seed + u.encode()).digest())
        place = {u: i for i, u in enumerate(ring)}
        offsets = range(1, n) if k == n - 1 else [d for h in range(1, k // 2 + 1) for d in (h, -h)]
        adjacent = {u: tuple(sorted(ring[(place[u] + d) % n] for d in offsets)) for u in names}
        return cls(names, params, seed, adjacent)

    @property
    def threshold(self) -> int:
        return self.params.threshold

    def neighbours(self, member: str) -> tuple[str, ...]:
        if member not in self._adjacent:
            raise SecAggError("not-a-member", f"{member} is not in this cohort")
        return self._adjacent[member]
