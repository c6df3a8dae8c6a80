"""The in-process broker's publisher flow control: a publish into a consumed queue that holds FLOW_BYTES of
ready messages waits until its consumer has taken some, so a fast publisher cannot pile up a backlog in the
process (RabbitMQ's credit flow does the same between a connection and its queue)."""

from __future__ import annotations

import threading

import pytest
from load_factor import budget

from fedmq.broker.transport import memory
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.memory import MemoryBroker

BODY = 100  # bytes a message


@pytest.fixture
def small_flow(monkeypatch):
    monkeypatch.setattr(memory, "FLOW_BYTES", 3 * BODY)  # three ready messages make the queue crowded
    monkeypatch.setattr(memory, "FLOW_CHECK_S", 0.05)


def _waiting_signal(b: MemoryBroker) -> threading.Event:
    """Set when a publisher starts waiting for room (the hub's condition's wait is wrapped)."""
    waiting = threading.Event()
    cond = b._hub.drained
    real = cond.wait

    def wait(timeout=None):
        waiting.set()
        return real(timeout)

    cond.wait = wait  # type: ignore[method-assign]
    return waiting


def test_a_publisher_waits_for_the_consumer_and_goes_on_when_it_takes(small_flow):
    pub, sub = MemoryBroker("flow-wait"), MemoryBroker("flow-wait")
    try:
        sub._hub.declare("q", {}, ("k",))
        held, first = [], threading.Event()

        def hold(d):  # takes one, acks nothing until told: the rest stay ready
            held.append(d)
            first.set()

        sub.consume("q", hold, prefetch=1)
        waiting = _waiting_signal(pub)
        sent: list[int] = []

        def publish_all():
            for i in range(6):
                pub.publish("k", bytes([i]) * BODY)
                sent.append(i)

        t = threading.Thread(target=publish_all, daemon=True)
        t.start()
        assert first.wait(budget(5))
        assert waiting.wait(budget(5)), "the publisher never waited with three messages ready"
        queue = sub._hub.queues["q"]
        assert queue.ready_bytes == 3 * BODY and len(sent) == 4  # one delivered, three ready, the fifth waits
        while t.is_alive() or held:  # each ack hands the consumer the next, which lets one more in
            assert _until(lambda: bool(held) or not t.is_alive())
            if held:
                sub.ack(held.pop(0))
        assert not t.is_alive() and sent == list(range(6))
        assert queue.ready_bytes == sum(len(m.body) for m in queue.ready)
    finally:
        pub.close()
        sub.close()


def test_no_wait_without_a_consumer_or_from_the_consumers_own_dispatcher(small_flow):
    b = MemoryBroker("flow-free")
    try:
        b._hub.declare("q", {}, ("k",))
        for i in range(6):  # nobody consumes: nothing to wait for (RabbitMQ queues keep them, too)
            b.publish("k", bytes([i]) * BODY)
        assert len(b._hub.queues["q"].ready) == 6
        done = threading.Event()
        published: list[int] = []

        def handler(d):  # runs on b's dispatcher, which consumes q: it must never wait on itself
            if len(published) < 6:
                b.publish("k", b"x" * BODY)
                published.append(1)
            b.ack(d)
            if len(published) == 6:
                done.set()

        b.consume("q", handler, prefetch=1)
        assert done.wait(budget(10))
    finally:
        b.close()


def test_a_waiting_publisher_of_a_closed_connection_ends_with_one_error(small_flow):
    pub, sub = MemoryBroker("flow-close"), MemoryBroker("flow-close")
    try:
        sub._hub.declare("q", {}, ("k",))
        sub.consume("q", lambda d: None, prefetch=1)
        waiting = _waiting_signal(pub)
        errors: list[BaseException] = []

        def publish_all():
            try:
                for i in range(6):
                    pub.publish("k", bytes([i]) * BODY)
            except Exception as exc:
                errors.append(exc)

        t = threading.Thread(target=publish_all, daemon=True)
        t.start()
        assert waiting.wait(budget(5))
        pub.close()
        t.join(budget(5))
        assert not t.is_alive()
        assert len(errors) == 1 and "closed" in str(errors[0])
        assert len(sub._hub.queues["q"].ready) == 3  # the waiting message was not pushed
    finally:
        sub.close()


def _until(cond, limit_s: float = 5.0) -> bool:
    done = threading.Event()
    deadline = budget(limit_s)
    step = 0.01
    waited = 0.0
    while not cond():
        if waited >= deadline:
            return False
        done.wait(step)
        waited += step
    return True


def test_a_publish_with_a_timeout_gives_up_on_a_crowded_queue_in_one_error(small_flow):
    pub, sub = MemoryBroker("flow-timeout"), MemoryBroker("flow-timeout")
    try:
        sub._hub.declare("q", {}, ("k",))
        sub.consume("q", lambda d: None, prefetch=1)  # takes one and acks nothing: the rest stay ready
        for i in range(4):
            pub.publish("k", bytes([i]) * BODY)
        with pytest.raises(BrokerError, match="not taken within 0.2 s"):
            pub.publish("k", b"late" * 25, timeout=0.2)  # a heartbeat's timeout: it must not wait for ever
        queue = sub._hub.queues["q"]
        assert len(queue.ready) == 3 and all(m.body != b"late" * 25 for m in queue.ready)
    finally:
        pub.close()
        sub.close()
