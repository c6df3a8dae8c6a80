"""Client-side dynamic pulling selection (client_agent.pulling)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from aggregator.strategies.errors import BadParameter
from client_agent.pulling import select_tensors, tensor_changes


def states(changes: dict[str, float]):
    """previous = zeros; current moved by d along one axis, so d_t = d exactly."""
    prev = {k: torch.zeros(2) for k in changes}
    cur = {k: torch.tensor([d, 0.0]) for k, d in changes.items()}
    return cur, prev


def test_dp_l_and_dp_g_pick_complementary_halves():
    cur, prev = states({"a": 1.0, "b": 4.0, "c": 2.0, "d": 3.0})
    groups = {k: "model" for k in cur}
    # median of (1, 2, 3, 4) = 2.5: dp-l sends d < 2.5 → a, c; dp-g sends d ≥ 2.5 → b, d (in state order)
    assert select_tensors(cur, prev, groups, "dp-l") == ["a", "c"]
    assert select_tensors(cur, prev, groups, "dp-g") == ["b", "d"]
    assert tensor_changes(cur, prev) == {"a": 1.0, "b": 4.0, "c": 2.0, "d": 3.0}


def test_odd_count_median_goes_to_dp_g():
    cur, prev = states({"a": 1.0, "b": 2.0, "c": 3.0})
    groups = {k: "model" for k in cur}
    assert select_tensors(cur, prev, groups, "dp-l") == ["a"]  # median 2: d < 2
    assert select_tensors(cur, prev, groups, "dp-g") == ["b", "c"]  # d ≥ 2


def test_thresholds_are_per_group():
    cur, prev = states({"e1": 1.0, "e2": 5.0, "d1": 10.0, "d2": 20.0})
    groups = {"e1": "encoder", "e2": "encoder", "d1": "decoder", "d2": "decoder"}
    # encoder median 3, decoder median 15 (one global median 7.5 would send e1, e2 for dp-l)
    assert select_tensors(cur, prev, groups, "dp-l") == ["e1", "d1"]
    assert select_tensors(cur, prev, groups, "dp-g") == ["e2", "d2"]


def test_one_third_variant():
    cur, prev = states({f"t{i}": float(i) for i in range(1, 7)})
    groups = {k: "model" for k in cur}
    # quantile(1..6, 0.33) = 1 + 0.33·5 = 2.65 → dp-l sends 1, 2; quantile(0.67) = 4.35 → dp-g sends 5, 6
    assert select_tensors(cur, prev, groups, "dp-l", fraction=0.33) == ["t1", "t2"]
    assert select_tensors(cur, prev, groups, "dp-g", fraction=0.33) == ["t5", "t6"]


def test_random_sends_the_same_count_reproducibly():
    cur, prev = states({f"t{i}": float(i) for i in range(1, 11)})
    groups = {k: "model" for k in cur}
    for make in (lambda: random.Random(5), lambda: np.random.default_rng(5)):
        a = select_tensors(cur, prev, groups, "random", rng=make())
        b = select_tensors(cur, prev, groups, "random", rng=make())
        assert a == b and len(a) == 5 and set(a) <= set(cur)
    picks = {tuple(select_tensors(cur, prev, groups, "random", rng=random.Random(s))) for s in range(20)}
    assert len(picks) > 1


def test_first_round_new_tensors_and_all():
    cur, prev = states({"a": 1.0, "b": 2.0})
    groups = {k: "model" for k in cur}
    assert select_tensors(cur, None, groups, "dp-l") == ["a", "b"]
    assert select_tensors(cur, {}, groups, "dp-g") == ["a", "b"]
    assert select_tensors(cur, prev, groups, "all") == ["a", "b"]
    cur["new"] = torch.ones(2)
    assert select_tensors(cur, prev, groups, "dp-l") == ["a", "new"]


@pytest.mark.parametrize("kwargs", [{"mode": "dp-x"}, {"mode": "dp-l", "fraction": 0.0}, {"mode": "dp-l", "fraction": 1.5}, {"mode": "random"}])
def test_bad_arguments(kwargs):
    cur, prev = states({"a": 1.0})
    with pytest.raises(BadParameter):
        select_tensors(cur, prev, {}, **kwargs)
