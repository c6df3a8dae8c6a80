"""Broker.subscribe: pull-style consuming, the same on both backends."""

from __future__ import annotations

import time

import pytest
from load_factor import budget

from fedmq.broker.transport import topology as t
from fedmq.broker.transport.connect import connect

AGENT = "agent-0"


@pytest.fixture
def broker(url, job_id):
    b = connect(url)
    b.declare_job(job_id, [AGENT])
    yield b
    b.close()


def _until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + budget(timeout)
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_next_takes_deliveries_in_order_and_qsize_is_the_backlog(broker, job_id):
    with broker.subscribe(t.q_control(job_id, AGENT), prefetch=8) as sub:
        assert sub.next(0.2) is None
        for i in range(3):
            broker.publish(t.rk_control(job_id), f"m{i}".encode(), message_id=f"m{i}")
        _until(lambda: sub.qsize() == 3)
        got = [sub.next(5) for _ in range(3)]
        assert [d.body for d in got] == [b"m0", b"m1", b"m2"] and sub.qsize() == 0
        for d in got:
            sub.ack(d)
        assert sub.next(0.2) is None
    assert broker.queue_depth(t.q_control(job_id, AGENT)) == 0


def test_reject_and_close_give_deliveries_back(broker, job_id):
    queue = t.q_control(job_id, AGENT)
    with broker.subscribe(queue, prefetch=4) as sub:
        for i in range(2):
            broker.publish(t.rk_control(job_id), f"m{i}".encode(), message_id=f"m{i}")
        first = sub.next(5)
        sub.reject(first, requeue=True)
        _until(lambda: sub.qsize() == 2)  # m1, then m0 again
        assert {d.message_id for d in (sub.next(5), sub.next(5))} == {"m0", "m1"}
    assert sub.next(0) is None  # closed: the consumer is cancelled, nothing is handed out any more
    _until(lambda: broker.queue_depth(queue) == 2)  # taken but never settled: back in the queue
    with broker.subscribe(queue) as again:
        back = [again.next(5), again.next(5)]
        assert {d.message_id for d in back} == {"m0", "m1"} and all(d.redelivered for d in back)
        again.reject(back[0])
        again.ack(back[1])
        assert again.next(0.3) is None  # rejected without requeue: gone
    assert broker.queue_depth(queue) == 0


def test_one_subscription_takes_several_queues_and_close_cancels_them_all(broker, job_id):
    sub = broker.subscribe(t.q_latest(job_id, AGENT), prefetch=1)
    sub.add(t.q_control(job_id, AGENT), prefetch=16)
    assert len(sub.tags) == 2 and broker.status()["consumers"] == 2
    broker.publish(t.rk_announce(job_id, AGENT), b"announce")
    broker.publish(t.rk_grant(job_id, AGENT), b"grant")
    got = [sub.next(5), sub.next(5)]
    assert sorted(d.body for d in got) == [b"announce", b"grant"]
    for d in got:
        sub.ack(d)
    sub.close()
    sub.close()  # twice is fine
    assert broker.status()["consumers"] == 0
