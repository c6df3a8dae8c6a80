"""Client-side dynamic pulling selection (fedmq.pulling)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fedmq.errors import BadParameter
from fedmq.pulling import select_tensors, tensor_changes


def states(changes: dict[str, float]):
    """previous = zeros; current moved by d along one axis, so d_t = d exactly."""
    prev = {k: torch.zeros(2) for k in changes}
    cur = {k: torch.tensor([d, 0.0]) for k, d in changes.items()}
    return cur, prev


def test_dp_l_and_dp_g_pick_complementary_halves():
    cur, prev = states({"a": 1.0, "b": 4.0, "c": 2.0, "d": 3.0})
    groups = {k: "model" for k in cur}
    # median of (1, 2, 3, 4) = 2.5: local sends d < 2.5 → a, c; global sends d ≥ 2.5 → b, d (in state order)
    assert select_tensors(cur, prev, groups, "local") == ["a", "c"]
    assert select_tensors(cur, prev, groups, "global") == ["b", "d"]
    assert tensor_changes(cur, prev) == {"a": 1.0, "b": 4.0, "c": 2.0, "d": 3.0}


def test_odd_count_median_goes_to_dp_g():
    cur, prev = states({"a": 1.0, "b": 2.0, "c": 3.0})
    groups = {k: "model" for k in cur}
    assert select_tensors(cur, prev, groups, "local") == ["a"]  # median 2: d < 2
    assert select_tensors(cur, prev, groups, "global") == ["b", "c"]  # d ≥ 2


def test_thresholds_are_per_group():
    cur, prev = states({"e1": 1.0, "e2": 5.0, "d1": 10.0, "d2": 20.0})
    groups = {"e1": "encoder", "e2": "encoder", "d1": "decoder", "d2": "decoder"}
    # encoder median 3, decoder median 15 (one global median 7.5 would send e1, e2 for local)
    assert select_tensors(cur, prev, groups, "local") == ["e1", "d1"]
    assert select_tensors(cur, prev, groups, "global") == ["e2", "d2"]


def test_one_third_variant():
    cur, prev = states({f"t{i}": float(i) for i in range(1, 7)})
    groups = {k: "model" for k in cur}
    # by count: quantile(1..6, 0.33) = 2.65 → local sends 1, 2; quantile(0.67) = 4.35 → global sends 5, 6
    assert select_tensors(cur, prev, groups, "local", fraction=0.33, by="count") == ["t1", "t2"]
    assert select_tensors(cur, prev, groups, "global", fraction=0.33, by="count") == ["t5", "t6"]
    # by parameters (six tensors of 2): 33 % of 12 = 3.96 → local stays within it (one tensor),
    # global reaches it
    assert select_tensors(cur, prev, groups, "local", fraction=0.33) == ["t1"]
    assert select_tensors(cur, prev, groups, "global", fraction=0.33) == ["t5", "t6"]


def sized(changes: dict[str, tuple[float, int]]):
    """Tensors of the given sizes moved by d (first element), so d_t = d and numel = size."""
    prev = {k: torch.zeros(n) for k, (_, n) in changes.items()}
    cur = {k: torch.cat([torch.tensor([d]), torch.zeros(n - 1)]) for k, (d, n) in changes.items()}
    return cur, prev


def test_fraction_is_a_share_of_parameters_as_in_the_paper():
    """A GRU LM's few big matrices move most: by count "50 %" ships them all (DP_g) or none (DP_l); by
    parameters each side gets about half the parameters (Passban et al.: 22,863,104 of 45,724,160)."""
    cur, prev = sized(
        {
            "emb": (9.0, 1000),
            "w_ih": (8.0, 600),
            "w_hh": (7.0, 400),
            "b_ih": (1.0, 10),
            "b_hh": (2.0, 10),
            "dec_b": (3.0, 980),
        }
    )
    groups = {k: "model" for k in cur}
    numel = {k: v.numel() for k, v in cur.items()}
    total = sum(numel.values())
    local = select_tensors(cur, prev, groups, "local")
    glob = select_tensors(cur, prev, groups, "global")
    assert set(local) | set(glob) == set(cur) and not set(local) & set(glob)  # exact complements at 50 %
    assert sum(numel[n] for n in local) <= total / 2 <= sum(numel[n] for n in glob)
    assert glob == ["emb", "w_ih"] and local == ["w_hh", "b_ih", "b_hh", "dec_b"]
    by_count = select_tensors(cur, prev, groups, "local", by="count")
    assert by_count == ["b_ih", "b_hh", "dec_b"]  # half the tensors, 33 % of the parameters here
    budget = sum(numel[n] for n in glob)
    for seed in range(10):  # random matches global's parameter budget (first fit), not its tensor count
        picked = select_tensors(cur, prev, groups, "random", rng=random.Random(seed))
        sent = sum(numel[n] for n in picked)
        assert sent <= budget and all(sent + numel[n] > budget for n in set(cur) - set(picked)), (
            seed,
            picked,
        )


def test_random_never_overshoots_by_a_big_tensor():
    """Stopping at the tensor that crosses the budget would send the 5,000-parameter embedding on top of the
    budget whenever it comes late in the random order; first fit keeps random within DP_g's count."""
    cur, prev = sized({"emb": (1.0, 5000), **{f"w{i}": (10.0 + i, 1000) for i in range(10)}})
    groups = {k: "model" for k in cur}
    glob = select_tensors(cur, prev, groups, "global")
    budget = sum(cur[n].numel() for n in glob)
    assert glob == [f"w{i}" for i in range(2, 10)] and budget == 8000  # 7,500 needed: eight 1,000s
    sends = [
        sum(cur[n].numel() for n in select_tensors(cur, prev, groups, "random", rng=random.Random(s)))
        for s in range(30)
    ]
    assert max(sends) <= budget and min(sends) >= budget - 1000, sends


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
    assert select_tensors(cur, None, groups, "local") == ["a", "b"]
    assert select_tensors(cur, {}, groups, "global") == ["a", "b"]
    assert select_tensors(cur, prev, groups, "all") == ["a", "b"]
    cur["new"] = torch.ones(2)
    assert select_tensors(cur, prev, groups, "local") == ["a", "new"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "dp-l"},
        {"mode": "local", "by": "bytes"},
        {"mode": "local", "fraction": 0.0},
        {"mode": "local", "fraction": 1.5},
        {"mode": "random"},
    ],
)
def test_bad_arguments(kwargs):
    cur, prev = states({"a": 1.0})
    with pytest.raises(BadParameter):
        select_tensors(cur, prev, {}, **kwargs)
