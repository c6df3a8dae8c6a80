"""The bounds on one client's influence (aggregator.guards): norms that cannot overflow, the lower median,
which updates a round drops or caps, and the non-finite check. The engine's use of them runs on real RabbitMQ
in tests/hostile/test_poison_bounds.py."""

from __future__ import annotations

import math

import pytest
import torch

from fedmq.aggregator.config import JobConfig, JobConfigError
from fedmq.aggregator.guards import RoundGuard, delta_norm, first_nonfinite, in_fold_order, lower_median
from fedmq.aggregator.strategies.base import ClientUpdate

GLOBAL = {"w": torch.ones(4, 3), "b": torch.zeros(3)}


def delta(client: str, n: int, value: float) -> ClientUpdate:
    return ClientUpdate(client, n, {k: torch.full_like(v, value) for k, v in GLOBAL.items()}, delta=True)


def judge(*updates: ClientUpdate, samples: float = 4.0, norm: float = 10.0):
    guard = RoundGuard(samples, norm)
    guard.begin()
    for u in updates:
        guard.note(u, GLOBAL)
    return guard.verdict()


def test_delta_norm_of_3e38_weights_is_finite_and_huge():
    assert delta_norm(delta("a", 1, 3e38), GLOBAL) == pytest.approx(3e38 * math.sqrt(15), rel=1e-6)
    full = ClientUpdate("a", 1, {k: torch.zeros_like(v) for k, v in GLOBAL.items()})  # θ_k = 0: Δ = −θ
    assert delta_norm(full, GLOBAL) == pytest.approx(math.sqrt(12))


def test_lower_median_ignores_one_outlier_and_takes_the_smaller_of_two():
    assert lower_median([1.0, 2.0, 1e30]) == 2.0
    assert lower_median([5.0, 1e30]) == 5.0
    assert lower_median([3.0, 1.0, 2.0, 1e30]) == 2.0


def test_honest_round_is_left_alone():
    verdict = judge(delta("a", 100, 0.1), delta("b", 300, 0.3), delta("c", 200, -0.2))
    assert not verdict and verdict.record() == {"dropped": {}, "capped": {}}


def test_overflow_attack_is_dropped_and_its_weight_does_not_matter():
    verdict = judge(delta("a", 100, 0.1), delta("b", 120, 0.1), delta("evil", 2**52, 3e38))
    assert list(verdict.dropped) == ["evil"] and "median" in verdict.dropped["evil"]
    assert verdict.capped == {}  # a dropped update is not capped as well


def test_huge_n_samples_with_a_normal_update_is_capped_to_factor_times_median():
    verdict = judge(delta("a", 100, 0.1), delta("b", 120, 0.1), delta("evil", 2**52, 0.1))
    assert verdict.dropped == {} and verdict.capped == {"evil": 480}


def test_weights_capped_as_the_reports_foretold_need_no_second_pass():
    """A synchronous round caps as it folds, at the cap the granted clients' reported n_k give; the close
    folds the round again only when its verdict differs from what was applied."""
    guard = RoundGuard(4.0, 10.0)
    guard.begin()
    guard.expect([100, 120, 2000])  # the lower median is 120: a cap of 480
    honest = [delta("a", 100, 0.1), delta("b", 120, 0.1)]
    big = delta("c", 2000, 0.1)
    assert all(guard.capped_ahead(u) is u for u in honest)
    folded = guard.capped_ahead(big)
    assert folded.n_samples == 480 and big.n_samples == 2000 and folded.tensors is big.tensors
    for u in (*honest, big):
        guard.note(u, GLOBAL)  # the guard judges the claims as sent
    verdict = guard.verdict()
    assert verdict.capped == {"c": 480} == guard.applied and not guard.refold_needed(verdict)
    # folded out of the grant's order (a retry after a rejection): the second pass's order differs
    assert guard.refold_needed(verdict, in_order=False)

    # an update whose n is not its report's, or a client that never delivers, moves the cap: fold again
    guard = RoundGuard(4.0, 10.0)  # no history yet: the cap is the claims'
    guard.begin()
    assert guard.cap_ahead is None and guard.applied == {}
    guard.expect([100, 120, 2000])
    for u in (delta("a", 100, 0.1), delta("b", 5000, 0.1), delta("c", 2000, 0.1)):
        guard.note(u, GLOBAL)
        guard.capped_ahead(u)
    verdict = guard.verdict()  # claims 100, 2000, 5000: the median is 2000 and nothing is capped
    assert verdict.capped == {} and guard.applied == {"b": 480, "c": 480} and guard.refold_needed(verdict)

    # a dropped update always means a second pass; no reports (a restart) and no history mean no cap ahead
    guard = RoundGuard(4.0, 10.0)
    guard.begin()
    guard.expect([100, 120, 130])
    for u in (delta("a", 100, 0.1), delta("b", 120, 0.1), delta("evil", 130, 3e38)):
        guard.note(u, GLOBAL)
        guard.capped_ahead(u)
    assert guard.refold_needed(guard.verdict())
    guard = RoundGuard(4.0, 10.0)
    guard.begin()
    guard.expect([])
    assert guard.cap_ahead is None


def test_with_a_history_the_cap_is_known_before_the_round():
    """After a round of three updates or more, the cap is samples_factor × the median of the earlier rounds'
    lower medians of n, whatever this round's claims: a round without a grant phase (no reports) caps as it
    folds, and one honest skewed round is folded once."""
    guard = RoundGuard(4.0, 10.0)
    guard.begin()
    guard.expect([])
    assert guard.cap_ahead is None  # a job's first round: the round's own median, known at its close
    for u in (delta("a", 100, 0.1), delta("b", 120, 0.1), delta("c", 2000, 0.1)):
        guard.note(u, GLOBAL)
    assert guard.verdict().capped == {"c": 480}  # the round's own lower median, 120; now the history's
    for claims in ([], [10**6, 10**6, 10**6]):  # a round's claims cannot raise it
        guard.begin()
        guard.expect(claims)
        assert guard.cap_ahead == 480
    guard.begin()
    guard.expect([1, 1, 1])  # reports far below the history bound it (HISTORY_SLACK × their median)
    assert guard.cap_ahead == 8
    guard.begin()
    guard.expect([])
    skewed = [delta("a", 70, 0.1), delta("b", 80, 0.1), delta("c", 5000, 0.1)]  # 2 × 80 > 120: the history's
    for u in skewed:
        guard.note(u, GLOBAL)
        guard.capped_ahead(u)
    verdict = guard.verdict()
    assert verdict.capped == {"c": 480} == guard.applied and not guard.refold_needed(verdict)
    assert list(guard.history_n) == [120.0, 80.0]  # this round's median joins the history for later rounds
    guard.begin()
    guard.expect([])
    assert guard.cap_ahead == int(4 * 100.0)  # the median of 120 and 80
    guard.note(delta("a", 100, 0.1), GLOBAL)  # a round of two: the history judges it too
    guard.note(delta("b", 500, 0.1), GLOBAL)
    assert guard.verdict().capped == {"b": 400}


def test_a_round_whose_clients_hold_little_bounds_the_historys_reference():
    """The history's reference is never above HISTORY_SLACK × a round's own lower median (K ≥ 3): two honest
    clients of n = 5 against a history of 100 do not let a third weigh 400; the close caps it at 4 × 2 × 5
    and the round is folded again with that cap."""
    guard = RoundGuard(4.0, 10.0)
    guard.begin()
    for u in (delta("a", 100, 0.1), delta("b", 100, 0.1), delta("c", 100, 0.1)):
        guard.note(u, GLOBAL)
    guard.verdict()
    guard.begin()
    guard.expect([])
    assert guard.cap_ahead == 400
    for u in (delta("a", 5, 0.1), delta("b", 5, 0.1), delta("evil", 10**6, 0.1)):
        guard.note(u, GLOBAL)
        guard.capped_ahead(u)
    verdict = guard.verdict()
    assert verdict.capped == {"evil": 40} and guard.applied == {"evil": 400}
    assert guard.refold_needed(verdict)


def test_a_lone_update_is_judged_against_the_models_norm_only():
    # no peer, no history: within half the model's norm (‖θ‖ = √12) it passes, whatever its n
    assert not judge(delta("a", 2**52, 0.4))
    assert "no reference" in judge(delta("evil", 1, 0.5)).dropped["evil"]
    assert "beyond float32" in judge(delta("evil", 2**52, 3e38)).dropped["evil"]


def test_factor_zero_turns_a_bound_off():
    assert judge(delta("a", 100, 0.1), delta("evil", 2**52, 3e38), norm=0).dropped == {}
    assert judge(delta("a", 100, 0.1), delta("evil", 2**52, 0.1), samples=0).capped == {}


def test_first_nonfinite_names_the_tensor():
    assert first_nonfinite(GLOBAL) is None
    assert first_nonfinite({"w": torch.ones(2), "b": torch.tensor([1.0, float("inf")])}) == "b"
    assert first_nonfinite({"w": torch.tensor([float("nan")])}) == "w"


@pytest.mark.parametrize("field", ["max_samples_factor", "norm_bound_factor"])
@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), True])
def test_bad_bound_setting_is_one_clear_error(field, value):
    with pytest.raises(JobConfigError, match=field):
        JobConfig(**{field: value})


def test_bounds_are_on_by_default():
    cfg = JobConfig()
    assert cfg.max_samples_factor > 0 and cfg.norm_bound_factor > 0


def test_a_near_zero_update_in_a_round_of_two_cannot_get_the_other_dropped():
    verdict = judge(delta("honest", 100, 0.1), delta("evil", 1, 1e-7))
    assert verdict.dropped == {}  # no history: a round of two drops nothing
    assert verdict.capped == {"honest": 4}  # the cap is still 4 x the smaller claim (documented limit)


def test_a_round_of_two_is_judged_against_earlier_rounds_of_three():
    guard = RoundGuard(4.0, 10.0)
    guard.begin()
    for u in (delta("a", 100, 0.1), delta("b", 120, 0.1), delta("c", 110, 0.1)):
        guard.note(u, GLOBAL)
    assert not guard.verdict()
    guard.begin()
    guard.note(delta("a", 100, 0.1), GLOBAL)
    guard.note(delta("evil", 1, 1e-7), GLOBAL)
    assert not guard.verdict()  # against history: the honest update is in bounds, and n = 1 caps nothing
    guard.begin()
    guard.note(delta("a", 100, 0.1), GLOBAL)
    guard.note(delta("evil", 2**52, 5.0), GLOBAL)
    verdict = guard.verdict()
    assert list(verdict.dropped) == ["evil"] and "earlier rounds" in verdict.dropped["evil"]
    restored = RoundGuard(4.0, 10.0)
    restored.load_state_dict(guard.state_dict())
    assert list(restored.history_norm) == list(guard.history_norm) and len(restored.history_n) == 1


def test_async_screen_judges_against_the_other_clients():
    guard = RoundGuard(4.0, 10.0)
    guard.begin()
    assert guard.screen(delta("evil", 2**52, 3e38), GLOBAL) is not None  # beyond float32 with no history
    # no other client has a vote yet: each update is held (folded for now), judged at the buffer's close
    for client, n in (("evil", 100), ("a", 100), ("b", 120)):
        update = delta(client, n, 0.1)
        assert guard.screen(update, GLOBAL) is None and client in guard.held and not guard.latest
    assert not guard.judge_held(GLOBAL) and not guard.held and set(guard.latest) == {"evil", "a", "b"}
    guard.begin()
    capped = delta("evil", 2**52, 0.1)
    assert guard.screen(capped, GLOBAL) is None and capped.n_samples == 480  # 4 x a's and b's upper median
    assert guard.screen(delta("evil", 100, 5.0), GLOBAL) is not None  # 50 x the others' median norm
    honest = delta("a", 100, 0.1)
    assert guard.screen(honest, GLOBAL) is None and honest.n_samples == 100  # within 4 x evil's and b's
    assert (
        not guard.held and list(guard.screened.dropped) == ["evil"] and guard.screened.capped == {"evil": 480}
    )


def test_async_first_buffer_is_judged_as_a_synchronous_round():
    """Held updates (no reference when they came) are judged together at the close: three or more by their
    own lower median, as a synchronous round; the verdict is keyed by update id, ``screened`` by client."""
    guard = RoundGuard(4.0, 10.0)
    guard.begin()
    updates = [delta("evil", 2**52, 1e3), delta("a", 100, 0.1), delta("b", 120, 0.12)]
    for i, update in enumerate(updates):
        update.update_id = f"m{i}"
        assert guard.screen(update, GLOBAL) is None  # 1e4 x the others: nothing to judge it by yet
    verdict = guard.judge_held(GLOBAL)
    assert list(verdict.dropped) == ["m0"] and "> 10 x median" in verdict.dropped["m0"]
    assert list(guard.screened.dropped) == ["evil"] and set(guard.latest) == {"a", "b"}
    assert len(guard.history_norm) == 1  # a buffer of three is a reference for later small ones
    # an honest-sized update with a huge claim is capped at 4 x the buffer's lower median n (the middle claim)
    guard = RoundGuard(4.0, 10.0)
    guard.begin()
    for update in (delta("evil", 2**52, 0.1), delta("a", 100, 0.1), delta("b", 120, 0.1)):
        guard.screen(update, GLOBAL)
    verdict = guard.judge_held(GLOBAL)
    assert verdict.capped == {"evil": 480} and not verdict.dropped and guard.latest["evil"][0] == 480
    # order does not matter: the same updates arriving the other way round get the same verdict
    guard = RoundGuard(4.0, 10.0)
    guard.begin()
    for update in (delta("b", 120, 0.1), delta("a", 100, 0.1), delta("evil", 2**52, 0.1)):
        guard.screen(update, GLOBAL)
    assert guard.judge_held(GLOBAL).capped == {"evil": 480}


def test_async_small_first_buffer_has_the_no_reference_rule():
    """Fewer than three held updates and no history: beyond half the model's norm is dropped (not shortened),
    and with two the larger claim is capped at 4 x the smaller."""
    guard = RoundGuard(4.0, 10.0)
    guard.begin()
    wipe = delta("evil", 2**52, -1.0)  # ‖Δ‖ = √15 > ½ ‖θ‖ = ½ √12
    guard.screen(wipe, GLOBAL)
    guard.screen(delta("a", 100, 0.1), GLOBAL)
    verdict = guard.judge_held(GLOBAL)
    assert list(verdict.dropped) == ["evil"] and "no reference yet" in verdict.dropped["evil"]
    assert torch.equal(wipe.tensors["w"], torch.full((4, 3), -1.0))  # judged, never altered
    guard.begin()
    claim = delta("b", 2**52, 0.1)
    guard.screen(claim, GLOBAL)  # one other client (a): its n is capped at once, the norm waits
    assert claim.n_samples == 400 and "b" in guard.held
    guard.withdraw(claim)  # refused by the strategy after the screen: no longer judged
    assert not guard.held and not guard.judge_held(GLOBAL)


def test_in_fold_order_compares_the_folded_clients_with_the_order_a_second_pass_folds_in():
    assert in_fold_order(["a", "c"], ["a", "b", "c"])  # b never came: still in order
    assert not in_fold_order(["c", "a"], ["a", "b", "c"])  # a late one folded after a later one
    assert in_fold_order([], ["a"])
