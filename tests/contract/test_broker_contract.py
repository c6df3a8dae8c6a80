"""One contract, two backends: the in-process broker and RabbitMQ must behave the same."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pika
import pytest
from load_factor import budget

from fedmq.broker.transport import topology as t
from fedmq.broker.transport.base import Broker, Delivery
from fedmq.broker.transport.connect import connect
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.memory import topic_matches
from fedmq.broker.transport.queues import job_queues
from fedmq.broker.wire.chunk_frames import CHUNK_HEADER

SMALL_CHUNK = 64 * 1024


class Inbox:
    """Collects deliveries from a handler; optionally acks them."""

    def __init__(self, broker: Broker, *, ack: bool = True) -> None:
        self.broker, self.auto_ack = broker, ack
        self.items: list[Delivery] = []
        self.cv = threading.Condition()

    def __call__(self, d: Delivery) -> None:
        if self.auto_ack:
            self.broker.ack(d)
        with self.cv:
            self.items.append(d)
            self.cv.notify_all()

    def wait(self, n: int, timeout: float = 10.0) -> list[Delivery]:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.items) >= n, budget(timeout)), (
                f"got {len(self.items)} of {n} deliveries"
            )
            return list(self.items)

    def settle(self, quiet: float = 0.3) -> list[Delivery]:
        """Wait until nothing new arrives for ``quiet`` seconds."""
        n = -1
        while n != len(self.items):
            n = len(self.items)
            time.sleep(quiet)
        return list(self.items)


def _delete_job(url: str, job: str, agents: tuple[str, ...]) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    for spec in job_queues(job, agents):
        ch.queue_delete(spec.name)
    conn.close()


AGENTS = ("a1", "a2")


@pytest.fixture(params=["memory", "rabbitmq"])
def make(request: pytest.FixtureRequest, job_id: str) -> Iterator[Callable[..., Broker]]:
    """make(**kw) -> a new connection to the backend under test; all closed
    (and the job deleted) at teardown."""
    if request.param == "memory":
        url = f"memory://contract-{uuid.uuid4().hex[:8]}"
    else:
        url = request.getfixturevalue("rabbit_url")
    opened: list[Broker] = []

    def factory(**kw: object) -> Broker:
        b = connect(url, **kw)  # type: ignore[arg-type]
        opened.append(b)
        return b

    factory.url = url  # type: ignore[attr-defined]
    yield factory
    for b in opened:
        b.close()
    if request.param == "rabbitmq":
        _delete_job(url, job_id, AGENTS)


def _depth(b: Broker, queue: str, want: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + budget(timeout)
    while (d := b.queue_depth(queue)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return d


def test_topic_routing_reaches_the_right_queues(make, job_id):
    b = make()
    b.declare_job(job_id, AGENTS)
    b.publish(t.rk_update(job_id, "a1"), b"u")
    b.publish(t.rk_report(job_id, "a2"), b"r")
    b.publish(t.rk_presence(job_id, "a2"), b"p")
    b.publish(t.rk_global(job_id), b"g")
    b.publish(t.rk_control(job_id), b"c")
    assert _depth(b, t.q_inbox(job_id), 3) == 3
    for a in AGENTS:
        assert b.queue_depth(t.q_latest(job_id, a)) == 1
        assert b.queue_depth(t.q_control(job_id, a)) == 1
    got = Inbox(b)
    b.consume(t.q_inbox(job_id), got)
    assert [d.body for d in got.wait(3)] == [b"u", b"r", b"p"]
    assert [d.routing_key for d in got.items] == [
        t.rk_update(job_id, "a1"),
        t.rk_report(job_id, "a2"),
        t.rk_presence(job_id, "a2"),
    ]
    assert all(d.user_id == b.user for d in got.items)
    assert _depth(b, t.q_inbox(job_id), 0) == 0


def test_unroutable_publish_raises_and_changes_nothing(make, job_id):
    b = make()
    b.declare_job(job_id, AGENTS)
    with pytest.raises(BrokerError, match="unroutable"):
        b.publish(f"job.{job_id}.nothing.here", b"x")
    assert b.queue_depth(t.q_inbox(job_id)) == 0
    assert b.status()["connected"] is True
    b.publish(t.rk_update(job_id, "a1"), b"after")  # the connection is still usable
    assert _depth(b, t.q_inbox(job_id), 1) == 1


def test_bad_input_is_one_typed_error(make, job_id):
    b = make()
    with pytest.raises(BrokerError, match="bad job id"):
        b.declare_job("no.dots", AGENTS)
    with pytest.raises(BrokerError, match="bad client id"):
        b.declare_job(job_id, ["a/b"])
    b.declare_job(job_id, AGENTS)
    with pytest.raises(BrokerError, match="body must be bytes"):
        b.publish(t.rk_update(job_id, "a1"), "text")  # type: ignore[arg-type]
    with pytest.raises(BrokerError, match="routing key"):
        b.publish("", b"x")
    with pytest.raises(BrokerError, match="no such queue|NOT_FOUND|404"):
        b.consume(f"fedmq.{job_id}.missing", lambda d: None)
    assert b.queue_depth(t.q_inbox(job_id)) == 0
    assert b.queue_depth(f"fedmq.{job_id}.missing") == 0


def test_per_queue_fifo_order(make, job_id):
    b = make()
    b.declare_job(job_id, AGENTS)
    for i in range(40):
        b.publish(t.rk_update(job_id, AGENTS[i % 2]), str(i).encode(), message_id=f"m{i}")
    got = Inbox(b)
    b.consume(t.q_inbox(job_id), got, prefetch=7)
    items = got.wait(40)
    assert [int(d.body) for d in items] == list(range(40))
    assert [d.message_id for d in items] == [f"m{i}" for i in range(40)]


def test_unacked_messages_are_redelivered_when_the_consumer_goes_away(make, job_id):
    pub = make()
    pub.declare_job(job_id, AGENTS)
    for i in range(5):
        pub.publish(t.rk_control(job_id), f"c{i}".encode())
    first = make()
    held = Inbox(first, ack=False)
    first.consume(t.q_control(job_id, "a1"), held, prefetch=3)
    assert [d.body for d in held.wait(3)] == [b"c0", b"c1", b"c2"]
    time.sleep(0.2)
    assert len(held.items) == 3  # prefetch bounds the unacked deliveries
    first.close()
    second = make()
    got = Inbox(second)
    second.consume(t.q_control(job_id, "a1"), got)
    items = got.wait(5)
    assert [d.body for d in items] == [b"c0", b"c1", b"c2", b"c3", b"c4"]
    assert [d.redelivered for d in items] == [True, True, True, False, False]
    assert _depth(second, t.q_control(job_id, "a1"), 0) == 0


def test_cancel_and_reject_requeue(make, job_id):
    b = make()
    b.declare_job(job_id, AGENTS)
    b.publish(t.rk_control(job_id), b"x")
    b.publish(t.rk_control(job_id), b"y")
    held = Inbox(b, ack=False)
    tag = b.consume(t.q_control(job_id, "a2"), held)
    held.wait(2)
    b.reject(held.items[0], requeue=False)  # dropped for good
    b.cancel(tag)  # y goes back
    assert _depth(b, t.q_control(job_id, "a2"), 1) == 1
    got = Inbox(b, ack=False)
    b.consume(t.q_control(job_id, "a2"), got)
    d = got.wait(1)[0]
    assert (d.body, d.redelivered) == (b"y", True)
    b.reject(d, requeue=True)
    d2 = got.wait(2)[1]
    assert (d2.body, d2.redelivered) == (b"y", True)
    b.ack(d2)
    b.ack(d2)  # a second ack of the same delivery is a no-op, not a channel error
    assert _depth(b, t.q_control(job_id, "a2"), 0) == 0
    b.publish(t.rk_control(job_id), b"z")
    assert got.wait(3)[2].body == b"z"


def test_max_length_queue_keeps_only_the_newest(make, job_id):
    b = make()
    b.declare_job(job_id, AGENTS)
    for v in (b"v1", b"v2", b"v3"):
        b.publish(t.rk_global(job_id), v)
    assert _depth(b, t.q_latest(job_id, "a1"), 1) == 1
    got = Inbox(b)
    b.consume(t.q_latest(job_id, "a1"), got)
    assert got.wait(1)[0].body == b"v3"
    assert len(got.settle()) == 1


def test_inbox_has_a_single_active_consumer_and_a_hot_standby(make, job_id):
    pub = make()
    pub.declare_job(job_id, AGENTS)
    active, standby = make(), make()
    got_a, got_s = Inbox(active), Inbox(standby)
    active.consume(t.q_inbox(job_id), got_a)
    time.sleep(0.2)
    standby.consume(t.q_inbox(job_id), got_s)
    for i in range(10):
        pub.publish(t.rk_update(job_id, "a1"), f"{i}".encode())
    got_a.wait(10)
    time.sleep(0.3)
    assert got_s.items == []
    active.close()
    time.sleep(0.3)
    for i in range(10, 15):
        pub.publish(t.rk_update(job_id, "a1"), f"{i}".encode())
    assert [int(d.body) for d in got_s.wait(5)] == list(range(10, 15))


def test_chunked_payload_arrives_whole_and_acks_every_chunk(make, job_id):
    b = make(chunk_limit=SMALL_CHUNK)
    b.declare_job(job_id, AGENTS)
    body = os.urandom(10 * SMALL_CHUNK + 123)
    b.publish(t.rk_update(job_id, "a1"), body, message_id="big-1", headers={"kind": "update"})
    assert _depth(b, t.q_inbox(job_id), 11) == 11  # eleven chunk messages on the wire
    got = Inbox(b)
    b.consume(t.q_inbox(job_id), got, prefetch=64)
    d = got.wait(1)[0]
    assert d.body == body and d.message_id == "big-1"
    assert d.headers.get("kind") == "update" and CHUNK_HEADER not in d.headers
    assert d.user_id == b.user
    assert len(got.settle()) == 1
    b.close()
    other = make()
    assert other.queue_depth(t.q_inbox(job_id)) == 0  # every chunk was acked


def test_chunked_message_larger_than_the_prefetch_window(make, job_id):
    b = make(chunk_limit=SMALL_CHUNK)
    b.declare_job(job_id, AGENTS)
    bodies = [os.urandom(12 * SMALL_CHUNK) for _ in range(2)]
    for i, body in enumerate(bodies):
        b.publish(t.rk_update(job_id, "a2"), body, message_id=f"m{i}")
    got = Inbox(b)
    b.consume(t.q_inbox(job_id), got, prefetch=4)
    assert [d.body for d in got.wait(2, timeout=20)] == bodies
    assert _depth(b, t.q_inbox(job_id), 0) == 0


def test_unacked_chunked_message_is_redelivered_whole(make, job_id):
    pub = make(chunk_limit=SMALL_CHUNK)
    pub.declare_job(job_id, AGENTS)
    body = os.urandom(5 * SMALL_CHUNK)
    pub.publish(t.rk_update(job_id, "a1"), body, message_id="m-redo")
    first = make()
    held = Inbox(first, ack=False)
    first.consume(t.q_inbox(job_id), held)
    assert held.wait(1)[0].body == body
    first.close()
    second = make()
    got = Inbox(second)
    second.consume(t.q_inbox(job_id), got)
    d = got.wait(1)[0]
    assert d.body == body and d.redelivered
    assert _depth(second, t.q_inbox(job_id), 0) == 0


def test_duplicate_chunks_are_dropped_and_malformed_chunks_rejected(make, job_id):
    b = make(chunk_limit=SMALL_CHUNK)
    b.declare_job(job_id, AGENTS)
    body = os.urandom(3 * SMALL_CHUNK)
    b.publish(t.rk_update(job_id, "a1"), body, message_id="dup")
    b.publish(t.rk_update(job_id, "a1"), body, message_id="dup")  # a republish after a lost confirm
    b.publish(t.rk_update(job_id, "a1"), b"\x99garbage", headers={CHUNK_HEADER: 1})
    b.publish(t.rk_update(job_id, "a1"), b"plain")
    got = Inbox(b)
    b.consume(t.q_inbox(job_id), got)
    items = got.wait(2)
    assert [d.body for d in got.settle()] == [body, b"plain"]
    assert items[0].message_id == "dup"
    assert _depth(b, t.q_inbox(job_id), 0) == 0


def test_a_failing_handler_rejects_and_the_consumer_goes_on(make, job_id):
    b = make()
    b.declare_job(job_id, AGENTS)
    seen: list[bytes] = []

    def handler(d: Delivery) -> None:
        seen.append(d.body)
        if d.body == b"boom":
            raise ValueError("bad message")
        b.ack(d)

    b.consume(t.q_inbox(job_id), handler)
    b.publish(t.rk_update(job_id, "a1"), b"boom")
    b.publish(t.rk_update(job_id, "a1"), b"fine")
    deadline = time.monotonic() + budget(5)
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert seen == [b"boom", b"fine"]
    assert _depth(b, t.q_inbox(job_id), 0) == 0


def test_status_reports_connection_facts(make, job_id):
    b = make()
    s = b.status()
    assert s["connected"] is True and s["blocked"] is False
    assert s["reconnects"] == 0 and s["unconfirmed"] == 0
    b.close()
    assert b.status()["connected"] is False
    with pytest.raises(BrokerError, match="closed"):
        b.publish(t.rk_global(job_id), b"x")


def test_topic_matching_wildcards():
    assert topic_matches("job.*.update.*", "job.j.update.a")
    assert not topic_matches("job.*.update.*", "job.j.update.a.b")
    assert topic_matches("job.#", "job")
    assert topic_matches("job.#", "job.j.update.a")
    assert topic_matches("#.a", "job.j.update.a")
    assert topic_matches("#", "")
    assert not topic_matches("job.*", "job")
    assert (
        topic_matches("a.#.z", "a.z")
        and topic_matches("a.#.z", "a.b.c.z")
        and not topic_matches("a.#.z", "a.b")
    )


def test_bad_urls_raise_one_line_errors():
    for url, msg in [
        ("nope", "bad broker URL"),
        ("http://x", "unsupported broker URL scheme"),
        ("memory://a/b", "bad memory broker URL"),
        ("memory://bad name", "bad memory broker name"),
    ]:
        with pytest.raises(BrokerError, match=msg) as exc:
            connect(url)
        assert "\n" not in str(exc.value)
    with pytest.raises(BrokerError, match="conflicts"):
        connect("memory://alice@hub", user="bob")
    with pytest.raises(BrokerError, match="prefetch"):
        connect("memory://hub", prefetch=0)


def test_memory_user_comes_from_url_or_argument():
    with connect("memory://alice@userhub") as a, connect("memory://userhub", user="bob") as b:
        assert (a.user, b.user) == ("alice", "bob")
        a.declare_job("juser", ["bob"])
        got = Inbox(b)
        b.consume(t.q_inbox("juser"), got)
        a.publish(t.rk_report("juser", "bob"), b"r")
        assert got.wait(1)[0].user_id == "alice"


def test_a_message_that_kills_its_consumer_is_dead_lettered_after_the_delivery_limit(make, job_id):
    """Each consumer dies holding the message (connection closed, unacked): past DELIVERY_LIMIT returns the
    inbox moves it to the job's dead-letter queue, where an operator finds it; the inbox then works on.
    A rejected message goes there too."""
    from fedmq.broker.transport.queues import DELIVERY_LIMIT

    pub = make()
    pub.declare_job(job_id, AGENTS)
    pub.publish(t.rk_update(job_id, "a1"), b"poison", message_id="m-poison")
    for attempt in range(DELIVERY_LIMIT + 1):
        victim = make()
        held = Inbox(victim, ack=False)
        victim.consume(t.q_inbox(job_id), held)
        assert held.wait(1)[0].body == b"poison", attempt
        victim.close()  # dies without settling it
    assert _depth(pub, t.q_dead(job_id), 1) == 1
    assert _depth(pub, t.q_inbox(job_id), 0) == 0
    pub.publish(t.rk_update(job_id, "a1"), b"next")
    pub.publish(t.rk_update(job_id, "a2"), b"refused")
    alive = make()
    got: list[bytes] = []
    done = threading.Event()

    def handle(d: Delivery) -> None:
        got.append(d.body)
        if d.body == b"refused":
            alive.reject(d, requeue=False)
            done.set()
        else:
            alive.ack(d)

    alive.consume(t.q_inbox(job_id), handle)
    assert done.wait(budget(10)) and got == [b"next", b"refused"]
    assert _depth(pub, t.q_dead(job_id), 2) == 2
    dead = Inbox(pub)
    pub.consume(t.q_dead(job_id), dead)
    items = dead.wait(2)
    assert [d.body for d in items] == [b"poison", b"refused"]
    assert items[0].message_id == "m-poison" and items[0].user_id == pub.user
