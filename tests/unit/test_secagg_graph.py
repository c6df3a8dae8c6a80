"""SecAgg+'s communication graph (fedmq/secagg/graph.py): a k-regular Harary graph laid out by a seed, the
same from the same (seed, cohort), and k and t chosen from the cohort size and the tolerated fractions."""

from __future__ import annotations

import math
import os

import pytest

from fedmq.errors import SecAggError
from fedmq.secagg.graph import CORRECTNESS_BITS, SECURITY_BITS, Cohort, GraphParams, plan

NAMES = [f"client-{i:03d}" for i in range(30)]


def test_the_graph_is_k_regular_and_symmetric():
    cohort = Cohort.build(NAMES, GraphParams(degree=6, threshold=3), os.urandom(32))
    for u in NAMES:
        mine = cohort.neighbours(u)
        assert len(mine) == 6 and u not in mine
        assert all(u in cohort.neighbours(v) for v in mine)


def test_the_same_seed_and_cohort_give_the_same_graph_in_any_order():
    seed = bytes(range(32))
    params = GraphParams(degree=8, threshold=4)
    first = Cohort.build(NAMES, params, seed)
    again = Cohort.build(list(reversed(NAMES)), params, seed)
    assert all(first.neighbours(u) == again.neighbours(u) for u in NAMES)
    other = Cohort.build(NAMES, params, bytes(32))
    assert any(first.neighbours(u) != other.neighbours(u) for u in NAMES)


def test_a_complete_graph_when_k_is_n_minus_1():
    cohort = Cohort.build(NAMES[:5], GraphParams(degree=4, threshold=2), os.urandom(32))
    assert all(set(cohort.neighbours(u)) == set(NAMES[:5]) - {u} for u in NAMES[:5])


def _tail(population: int, marked: int, draws: int, at_least: int) -> float:
    """Hypergeometric P[X ≥ at_least] from scipy, an independent cross-check of graph.py's exact sums."""
    from scipy.stats import hypergeom

    return float(hypergeom.sf(at_least - 1, population, marked, draws))


@pytest.mark.parametrize(("n", "gamma", "delta"), [(20, 0.1, 0.3), (100, 0.1, 0.3), (100, 0.05, 0.05)])
def test_plan_meets_the_papers_conditions(n, gamma, delta):
    found = plan(n, gamma, delta)
    k, t = found.degree, found.threshold
    corrupt, dropped = math.floor(gamma * n), math.floor(delta * n)
    security, correctness = 2.0 ** -(SECURITY_BITS + 1) / n, 2.0**-CORRECTNESS_BITS / n
    assert k % 2 == 0 and 2 <= t <= k < n - 1
    assert _tail(n - 1, corrupt, k, t) <= security  # t or more corrupted neighbours: negligible
    assert 1 - _tail(n - 1, n - 1 - dropped, k, t) <= correctness  # fewer than t survivors: negligible
    if t > 2:  # t is the smallest that is secure
        assert _tail(n - 1, corrupt, k, t - 1) > security


def test_plan_figures_for_the_cohorts_the_docs_quote():
    assert plan(20, 0.1, 0.3) == GraphParams(degree=10, threshold=3)
    assert plan(100, 0.1, 0.3) == GraphParams(degree=34, threshold=11)
    assert plan(10, 0.2, 0.3) == GraphParams(degree=6, threshold=3)


def test_small_cohorts_fall_back_to_the_complete_graph_or_are_refused():
    assert plan(5, 0.2, 0.2) == GraphParams(degree=4, threshold=2)
    with pytest.raises(SecAggError, match="a cohort of 5 cannot tolerate 2 corrupted and 2 dropped"):
        plan(5, 0.4, 0.4)
    with pytest.raises(SecAggError, match="a cohort of 2"):
        plan(2, 0.0, 0.0)
    with pytest.raises(SecAggError, match="dropout fraction"):
        plan(10, 0.1, 1.0)


def test_a_bad_cohort_is_refused_in_one_line():
    params = GraphParams(degree=4, threshold=2)
    for members, seed, message in [
        (["a", "a", "b", "c", "d", "e"], bytes(32), "distinct"),
        (NAMES[:6], b"short", "seed"),
    ]:
        with pytest.raises(SecAggError, match=message):
            Cohort.build(members, params, seed)
    with pytest.raises(SecAggError, match="stranger is not in this cohort"):
        Cohort.build(NAMES[:6], params, bytes(32)).neighbours("stranger")
    with pytest.raises(SecAggError, match="degree 3, threshold 2 for 6 members"):
        Cohort.build(NAMES[:6], GraphParams(degree=3, threshold=2), bytes(32))
