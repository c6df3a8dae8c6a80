"""Mediator: top-K grants and the loss switch."""

from __future__ import annotations

import pytest

from fedmq.aggregator.mediator import Mediator
from fedmq.errors import BadParameter


def test_top_k_picks_lowest_losses_with_id_tie_break():
    reports = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 1.0}
    # β = 0.5, M = 4 → K = 2: the two losses of 1.0, b before d
    assert Mediator.top_k(reports, 0.5) == ["b", "d"]
    # β = 0.75 → K = 3
    assert Mediator.top_k(reports, 0.75) == ["b", "d", "c"]
    # β = 0.6 → K = ceil(2.4) = 3
    assert Mediator.top_k(reports, 0.6) == ["b", "d", "c"]
    assert Mediator.top_k(reports, 1.0) == ["b", "d", "c", "a"]
    # β·M exactly integral despite float rounding: ceil(0.3·10) = 3 (0.3·10 = 3.0000000000000004)
    assert len(Mediator.top_k({str(i): float(i) for i in range(10)}, 0.3)) == 3
    assert Mediator.top_k({}, 0.5) == []


def test_top_k_rejects_bad_input():
    with pytest.raises(BadParameter, match="beta"):
        Mediator.top_k({"a": 1.0}, 0.0)
    with pytest.raises(BadParameter, match="beta"):
        Mediator.top_k({"a": 1.0}, 1.5)
    with pytest.raises(BadParameter, match="loss reported by 'a' must be a finite number"):
        Mediator.top_k({"a": float("nan"), "b": 1.0}, 0.5)


def test_switch_flips_exactly_at_epsilon():
    m = Mediator(epsilon=0.25)
    assert m.choose(2.0) == "adaptive"  # first round: no previous loss → adaptive
    assert m.choose(2.25) == "adaptive"  # |2.25 − 2.0| = 0.25 ≥ ε
    assert m.choose(2.0078125) == "fedavg"  # |2.0078125 − 2.25| = 0.2421875 < ε
    assert m.choose(1.7578125) == "adaptive"  # a drop of exactly 0.25 counts as well
    assert [c for _, c in m.history] == ["adaptive", "adaptive", "fedavg", "adaptive"]


def test_default_epsilon_and_mean_loss():
    m = Mediator()
    assert m.epsilon == 0.1
    assert Mediator.mean_loss({"a": 1.0, "b": 2.0, "c": 6.0}) == 3.0
    with pytest.raises(BadParameter):
        Mediator.mean_loss({})


def test_state_round_trip_and_malformed_state_changes_nothing():
    m = Mediator(epsilon=0.25)
    m.choose(4.0)
    m.choose(3.0)
    restored = Mediator()
    restored.load_state_dict(m.state_dict())
    assert restored.previous_loss == 3.0 and restored.epsilon == 0.25 and restored.history == m.history
    assert restored.choose(2.9) == "fedavg"
    before = restored.state_dict()
    with pytest.raises(BadParameter, match="malformed|finite"):
        restored.load_state_dict({"previous_loss": "x", "history": []})
    assert restored.state_dict() == before
