"""RabbitMQ backend under faults, on a private node: restarts, forced closes, big messages,
TLS, heartbeats."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest
from load_factor import budget

from fedmq.broker.transport import topology as t
from fedmq.broker.transport.base import Delivery
from fedmq.broker.transport.connect import connect
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.tls import TlsOptions

pytestmark = [pytest.mark.rabbitmq, pytest.mark.isolated_node, pytest.mark.slow]


class Collector:
    """The aggregator side: acks everything and deduplicates by message id."""

    def __init__(self, broker) -> None:
        self.broker = broker
        self.ids: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, d: Delivery) -> None:
        with self.lock:
            self.ids.append(d.message_id)
        self.broker.ack(d)

    def unique(self) -> set[str]:
        with self.lock:
            return set(self.ids)


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + budget(timeout)
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _stream_through_fault(node, job_id: str, fault) -> None:
    """Publish a stream of confirmed updates, inject ``fault`` mid-stream, check none is lost after dedup."""
    agg = connect(node.url, publish_timeout=90)
    agent = connect(node.url, publish_timeout=90, chunk_limit=256 * 1024)
    try:
        agg.declare_job(job_id, ["a1"])
        got = Collector(agg)
        agg.consume(t.q_inbox(job_id), got)
        confirmed: list[str] = []
        errors: list[str] = []

        def publisher() -> None:
            for i in range(120):
                mid = f"u{i}"
                body = os.urandom(600 * 1024 if i % 10 == 0 else 2048)  # every tenth update is chunked
                try:
                    agent.publish(t.rk_update(job_id, "a1"), body, message_id=mid)
                except BrokerError as exc:
                    errors.append(f"{mid}: {exc}")
                    continue
                confirmed.append(mid)
                time.sleep(0.01)

        th = threading.Thread(target=publisher)
        th.start()
        _wait(lambda: len(confirmed) >= 30, 30, "30 confirmed updates")
        fault()
        th.join(timeout=budget(180))
        assert not th.is_alive()
        assert errors == []  # publish() blocked through the outage and was confirmed after reconnecting
        _wait(lambda: set(confirmed) <= got.unique(), 90, "every confirmed update at the aggregator")
        assert got.unique() == set(confirmed)
        assert len(confirmed) == 120
        # on a loaded machine the stream can end before the node goes down: both sides then reconnect after it
        _wait(
            lambda: agent.status()["reconnects"] >= 1 and agg.status()["reconnects"] >= 1,
            60,
            "both sides reconnected",
        )
        _wait(lambda: agent.status()["connected"], 60, "the agent connected again")
        assert agent.status()["unconfirmed"] == 0
        _wait(lambda: agg.queue_depth(t.q_inbox(job_id)) == 0, 30, "an empty inbox")
    finally:
        agent.close()
        agg.close()


def test_broker_restart_via_stop_app_loses_no_confirmed_update(rabbit_node, job_id):
    def fault() -> None:
        rabbit_node.stop_app()  # clients get 320 CONNECTION_FORCED
        time.sleep(2)
        rabbit_node.start_app()

    _stream_through_fault(rabbit_node, job_id, fault)


def test_broker_kill9_loses_no_confirmed_update(rabbit_node, job_id):
    # RabbitMQ 3.10 records a new quorum queue's Ra registration in a DETS table it syncs every few minutes;
    # a kill -9 before that loses the queue itself. A graceful restart persists it,
    # as time would in production.
    with connect(rabbit_node.url) as b:
        b.declare_job(job_id, ["a1"])
    rabbit_node.stop_app()
    rabbit_node.start_app()

    def fault() -> None:
        rabbit_node.kill9()
        rabbit_node.start()

    _stream_through_fault(rabbit_node, job_id, fault)


def test_connection_closed_by_broker_recovers_on_its_own(rabbit_node, job_id):
    with connect(rabbit_node.url) as b:
        b.declare_job(job_id, ["a1"])
        got = Collector(b)
        b.consume(t.q_latest(job_id, "a1"), got)
        b.publish(t.rk_global(job_id), b"before", message_id="before")
        _wait(lambda: "before" in got.unique(), 10, "the first message")
        rabbit_node.close_connections("test closes it")
        _wait(lambda: b.status()["reconnects"] >= 1, 20, "a reconnect")
        b.publish(t.rk_global(job_id), b"after", message_id="after")  # topology and consumer restored
        _wait(lambda: "after" in got.unique(), 20, "a message after the reconnect")
        assert b.status()["connected"]


def test_a_lost_confirm_is_published_again_on_a_new_channel(rabbit_node, job_id):
    """Confirms that never come (lost in a quorum queue's leader change) hold the publisher only
    confirm_stall_s, not the publish deadline: the unconfirmed parts go out again on a new channel, once."""
    agg = connect(rabbit_node.url)
    agent = connect(rabbit_node.url, chunk_limit=64 * 1024, confirm_stall_s=1.0, publish_timeout=60)
    try:
        agg.declare_job(job_id, ["a1"])
        got = Collector(agg)
        agg.consume(t.q_inbox(job_id), got)
        deaf, lost, abandoned = [True], [], []
        on_confirm, abandon = agent._publisher.on_confirm, agent._publisher.abandon_channel

        def lossy(frame) -> None:  # every confirm of a publish's first channel is lost on the way
            if deaf[0]:
                lost.append(frame.method.delivery_tag)
                return
            on_confirm(frame)

        def abandon_and_hear(job) -> None:
            abandoned.append(job.message_id)
            abandon(job)
            deaf[0] = False

        agent._publisher.on_confirm, agent._publisher.abandon_channel = lossy, abandon_and_hear
        for mid, body in (("small", b"x" * 100), ("big", os.urandom(300 * 1024))):  # big: 5 chunks
            deaf[0] = True
            t0 = time.monotonic()
            agent.publish(t.rk_update(job_id, "a1"), body, message_id=mid)
            assert 1.0 <= time.monotonic() - t0 < budget(20), (
                "held until the deadline, or no confirm was lost"
            )
        assert abandoned == ["small", "big"] and lost
        _wait(lambda: got.unique() == {"small", "big"}, 20, "both messages")
        time.sleep(1.0)
        assert got.ids.count("big") == 1  # duplicate chunks of a delivered message are dropped by reassembly
        assert got.ids.count("small") == 2  # at least once: the aggregator drops duplicates by message id
    finally:
        agent.close()
        agg.close()


def test_a_nacked_publish_is_retried_on_a_new_channel(rabbit_node, job_id):
    """A channel that nacks (after a failover, one may nack every publish to a quorum queue whose leader
    moved) is given up: the retry goes out on a new channel and the message arrives once."""
    import pika

    agg = connect(rabbit_node.url)
    agent = connect(rabbit_node.url, publish_timeout=30)
    try:
        agg.declare_job(job_id, ["a1"])
        got = Collector(agg)
        agg.consume(t.q_inbox(job_id), got)
        channels, on_confirm = [], agent._publisher.on_confirm

        def nack_first_channel(frame) -> None:  # the broker acked; the first channel "nacks" instead
            if agent._publisher.channel not in channels:
                channels.append(agent._publisher.channel)
            if agent._publisher.channel is channels[0]:
                frame = pika.frame.Method(
                    frame.channel_number, pika.spec.Basic.Nack(frame.method.delivery_tag)
                )
            on_confirm(frame)

        agent._publisher.on_confirm = nack_first_channel
        first = agent.status()
        agent.publish(t.rk_update(job_id, "a1"), b"u" * 100, message_id="u1")
        assert len(channels) == 2, channels  # nacked on one channel, confirmed on the next
        _wait(lambda: got.unique() == {"u1"}, 20, "the message")
        assert agent.status()["reconnects"] == first["reconnects"]  # a channel, not the connection
    finally:
        agent.close()
        agg.close()


def test_300mb_update_crosses_a_broker_with_16mib_max_message_size(rabbit_node, job_id):
    body = os.urandom(300 * 1024 * 1024)
    want = hashlib.blake2b(body, digest_size=16).digest()
    with connect(rabbit_node.url, chunk_limit=32 * 1024 * 1024) as raw:
        raw.declare_job(job_id, ["a1"])
        with pytest.raises(BrokerError, match="refused|406|max"):
            raw.publish(t.rk_update(job_id, "a1"), body[: 20 * 1024 * 1024])  # the limit is real
    got: list[tuple[bytes, str | None]] = []
    done = threading.Event()
    with connect(rabbit_node.url) as agg, connect(rabbit_node.url) as agent:
        agg.consume(
            t.q_inbox(job_id),
            lambda d: (
                got.append((hashlib.blake2b(d.body, digest_size=16).digest(), d.message_id)),
                agg.ack(d),
                done.set(),
            ),
        )
        agent.publish(t.rk_update(job_id, "a1"), body, message_id="huge")
        del body
        assert done.wait(budget(180))
        assert got == [(want, "huge")]
        _wait(lambda: agg.queue_depth(t.q_inbox(job_id)) == 0, 30, "an empty inbox")


def test_tls_with_client_certificate(rabbit_node, job_id):
    c = rabbit_node.certs
    tls = TlsOptions(ca_file=c.ca, cert_file=c.client_cert, key_file=c.client_key)
    with connect(rabbit_node.tls_url, tls=tls) as b:
        b.declare_job(job_id, ["a1"])
        got = Collector(b)
        b.consume(t.q_control(job_id, "a1"), got)
        b.publish(t.rk_control(job_id), b"over tls", message_id="tls-1")
        _wait(lambda: got.unique() == {"tls-1"}, 10, "a message over TLS")
    with pytest.raises(BrokerError, match="cannot connect"):
        connect(rabbit_node.tls_url, tls=TlsOptions(ca_file=c.ca), connect_timeout=3)  # no client certificate
    with pytest.raises(BrokerError, match="does not exist"):
        connect(rabbit_node.tls_url, tls=TlsOptions(ca_file="/nonexistent/ca.pem"))


def test_long_blocking_step_does_not_lose_the_connection(rabbit_node, job_id):
    """A 'training step' holding a thread (and the GIL in Python code) for > 2x the heartbeat."""
    with connect(rabbit_node.url, heartbeat=1) as b:
        b.declare_job(job_id, ["a1"])
        done = threading.Event()

        def train(d: Delivery) -> None:
            end = time.monotonic() + 3.5  # busy Python loop in the handler thread
            x = 0
            while time.monotonic() < end:
                x += 1
            b.ack(d)
            done.set()

        b.consume(t.q_latest(job_id, "a1"), train)
        b.publish(t.rk_global(job_id), b"theta")
        time.sleep(3.5)  # and the caller's own thread sleeps through several heartbeats
        assert done.wait(budget(10))
        s = b.status()
        assert s["connected"] and s["reconnects"] == 0
        assert rabbit_node.connection_count() >= 1
        b.publish(t.rk_global(job_id), b"theta2")


def test_unreachable_broker_is_one_line_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    t0 = time.monotonic()
    with pytest.raises(BrokerError, match="cannot connect") as exc:
        connect(f"amqp://guest:guest@127.0.0.1:{port}/%2F", connect_timeout=2)
    assert "\n" not in str(exc.value) and time.monotonic() - t0 < budget(15)


def test_flow_control_blocking_is_surfaced_in_status(rabbit_node, job_id):
    with connect(rabbit_node.url) as b:
        b.declare_job(job_id, ["a1"])
        b.publish(t.rk_global(job_id), b"before")
        rabbit_node.ctl(
            "set_vm_memory_high_watermark", "0.000001"
        )  # raise a memory alarm on the private node
        try:
            result: list[object] = []
            th = threading.Thread(
                target=lambda: result.append(b.publish(t.rk_global(job_id), b"during", timeout=60))
            )
            th.start()
            _wait(lambda: b.status()["blocked"], 20, "the connection.blocked notification")
            assert th.is_alive()  # the publish waits while the broker blocks us
        finally:
            rabbit_node.ctl("set_vm_memory_high_watermark", "0.4")
        th.join(timeout=budget(30))
        assert result == [None]  # confirmed once unblocked
        _wait(lambda: not b.status()["blocked"], 20, "connection.unblocked")
        assert b.status()["reconnects"] == 0
