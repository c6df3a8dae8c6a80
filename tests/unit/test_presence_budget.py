"""Each sender's presence budget (aggregator.presence_budget) and a host's word for its clients
(aggregator.presence): no broker, deliveries made by hand."""

from __future__ import annotations

from collections import Counter

from structlog.testing import capture_logs

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.inbox import Received
from fedmq.aggregator.presence import Presence
from fedmq.aggregator.presence_budget import PER_WINDOW, PresenceBudget
from fedmq.broker.transport import topology as t
from fedmq.broker.transport.base import Delivery
from fedmq.broker.wire import messages


def _delivery(key: str, user: str | None) -> Delivery:
    return Delivery(b"", key, "fedmq.j.inbox", user_id=user)


def test_a_flooder_is_cut_at_its_allowance_and_named_once_a_window():
    budget = PresenceBudget(60.0)
    flood = _delivery(t.rk_presence("j", "h0"), t.host_user("j", "h0"))
    honest = _delivery(t.rk_presence("j", "a0"), "j.a0")
    with capture_logs() as logs:
        admitted = [budget.admit(flood) for _ in range(1000)]
    assert sum(admitted) == PER_WINDOW and budget.over == {"j.host.h0": 1000 - PER_WINDOW}
    assert [e["sender"] for e in logs] == ["j.host.h0"]
    assert budget.admit(honest)  # another sender's budget is its own
    assert budget.admit(_delivery(t.rk_update("j", "h0-1"), "j.host.h0"))  # only presence counts
    budget._window_end = 0.0  # the next window: a new allowance, named again if over it
    with capture_logs() as logs:
        assert sum(budget.admit(flood) for _ in range(100)) == PER_WINDOW
    assert len(logs) == 1


def test_under_a_shared_identity_the_routing_key_names_the_sender():
    budget = PresenceBudget(60.0, shared=True)
    for client in ("a0", "a1"):
        key = t.rk_presence("j", client)
        assert all(budget.admit(_delivery(key, "guest")) for _ in range(PER_WINDOW))
    assert not budget.admit(_delivery(t.rk_presence("j", "a0"), "guest"))


class _Inbox:
    def __init__(self) -> None:
        self.dropped: Counter[str] = Counter()

    def ack(self, msg: Received) -> None:
        pass

    def drop(self, msg: Received, reason: str) -> None:
        self.dropped[reason] += 1


def _note(presence: Presence, env, user: str) -> list[str]:
    return presence.note(Received(env, _delivery(t.rk_presence("j", env.client), user), 0))


def test_a_host_speaks_only_for_clients_of_its_roster_and_its_budget_grows_with_it():
    inbox = _Inbox()
    presence = Presence(JobConfig(job="j", clients=40), inbox)  # type: ignore[arg-type]
    host = t.host_user("j", "h0")
    assert presence.allowance(host) == PER_WINDOW  # no roster yet
    _note(presence, messages.host_presence("j", "h0", "online", [(0, 10)]), host)
    assert presence.allowance(host) == PER_WINDOW + 20
    for phantom in ("h0-5000", "h0-10"):  # past the population, past its roster
        _note(presence, messages.presence("j", phantom, "online", 0), host)
    assert inbox.dropped == {"client-outside-roster": 2}
    _note(presence, messages.presence("j", "h0-3", "online", 2), host)
    assert presence.online() == sorted(f"h0-{n}" for n in range(10)) and presence.holds("h0-3") == 2
