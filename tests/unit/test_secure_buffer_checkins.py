"""A secure buffer's check-ins (aggregator.secure_buffers.CheckIns): one a client, the newer kept and the
older held until its client is told (its report acked: nothing will use it); a report is held beside the
check-in of its version and both are settled together (acked when taken, the check-in dropped with its
reason when not), so that nothing is acked before it is used."""

from __future__ import annotations

from types import SimpleNamespace

from fedmq.aggregator.inbox import Received
from fedmq.aggregator.secure_buffers import CheckIns
from fedmq.broker.wire import messages
from fedmq.broker.wire.envelope import Kind


class Settled:
    """The inbox's side of it: which deliveries were acked, and which dropped with what reason."""

    def __init__(self) -> None:
        self.acked: list[str] = []
        self.dropped: list[tuple[str, str]] = []

    def ack(self, msg: Received) -> None:
        self.acked.append(msg.env.msg_id)

    def drop(self, msg: Received, reason: str) -> None:
        self.dropped.append((msg.env.msg_id, reason))


def _received(env) -> Received:
    return Received(env, SimpleNamespace(body=b""), 0)  # type: ignore[arg-type]


def _check_in(client: str, version: int) -> Received:
    payload = {"channel": bytes(32), "mask": bytes(32)}
    return _received(messages.secagg(Kind.SECAGG_KEYS, "job", 1, client, version, payload))


def test_a_client_checks_in_once_the_newer_kept_and_its_report_settles_with_it():
    inbox = Settled()
    ctx = SimpleNamespace(inbox=inbox)
    checkins = CheckIns()
    report = _received(messages.report("job", 1, "a", 0, 2.5, 40))
    first, second, other = _check_in("a", 0), _check_in("a", 1), _check_in("b", 0)
    for msg in (report, first, other, second):
        assert checkins.take(ctx, msg)  # type: ignore[arg-type]
    assert not checkins.take(ctx, _received(messages.presence("job", "a", "online", 0)))  # type: ignore[arg-type]
    # the replaced check-in is held until its client is told (SecureBuffer._tell_superseded); its report,
    # which nothing will use, is acked
    assert checkins.superseded == [("a", first)] and inbox.dropped == []
    assert inbox.acked == [report.env.msg_id] and checkins.samples("a", 0) is None
    assert list(checkins.waiting) == ["b", "a"] and checkins.waiting["a"] is second  # b came first now
    newer = _received(messages.report("job", 2, "a", 1, 2.0, 30))
    checkins.take(ctx, newer)  # type: ignore[arg-type]
    assert checkins.samples("a", 1) == 30 and checkins.loss("a", 1) == 2.0
    assert checkins.samples("b", 0) is None
    checkins.settle(ctx, "a")  # type: ignore[arg-type]
    assert inbox.acked[1:] == [second.env.msg_id, newer.env.msg_id] and checkins.samples("a", 1) is None
    checkins.settle(ctx, "b", "too-stale")  # type: ignore[arg-type]
    assert inbox.dropped[-1] == (other.env.msg_id, "too-stale") and not checkins.waiting


def test_a_report_pairs_with_the_check_in_of_its_own_version():
    """A hosted client trains again while its check-in waits: the newer report must not stand for the older
    check-in, and it waits for its own check-in when the older one is settled."""
    inbox = Settled()
    ctx = SimpleNamespace(inbox=inbox)
    checkins = CheckIns()
    older = _received(messages.report("job", 1, "a", 0, 3.0, 40))
    check_in = _check_in("a", 0)
    newer = _received(messages.report("job", 2, "a", 1, 2.0, 30))
    for msg in (older, check_in, newer):
        checkins.take(ctx, msg)  # type: ignore[arg-type]
    assert checkins.loss("a", 0) == 3.0 and checkins.samples("a", 1) == 30
    checkins.settle(ctx, "a")  # type: ignore[arg-type]
    assert inbox.acked == [check_in.env.msg_id, older.env.msg_id]  # the newer report is still held
    assert checkins.samples("a", 1) == 30 and checkins.samples("a", 0) is None
    checkins.settle(ctx, "a")  # type: ignore[arg-type]  (no check-in waiting: its reports all go)
    assert inbox.acked[-1] == newer.env.msg_id and not checkins.reports


def test_the_check_ins_of_a_buffer_a_restart_closed_are_never_taken_again():
    inbox = Settled()
    ctx = SimpleNamespace(inbox=inbox)
    checkins = CheckIns()
    given_again, other = _check_in("a", 0), _check_in("b", 0)
    for msg in (given_again, other):
        checkins.take(ctx, msg)  # type: ignore[arg-type]
    checkins.interrupt(ctx, [given_again.env.msg_id])  # type: ignore[arg-type]
    assert list(checkins.waiting) == ["b"] and inbox.dropped == [(given_again.env.msg_id, "interrupted")]
    assert checkins.take(ctx, given_again)  # type: ignore[arg-type]  (the broker gives it once more)
    assert list(checkins.waiting) == ["b"] and inbox.dropped[-1] == (given_again.env.msg_id, "interrupted")
