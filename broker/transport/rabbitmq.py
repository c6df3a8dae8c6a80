"""The RabbitMQ backend (``amqp://``, ``amqps://``) on pika's BlockingConnection.

RabbitBroker is made of its responsibilities, each in its own module: the I/O thread that owns the connection
and runs the commands other threads queue (broker.transport.rabbit_io), reconnection and failover across the
nodes of the URL (rabbit_reconnect), publishing with confirms (rabbit_publish), consuming and the dispatcher
thread (rabbit_consume), and pika's private attributes (pika_private, checked at connect). This module puts
them together and holds the job's topology, which is declared again after a reconnect with the consumers.
"""

from __future__ import annotations

import threading
from typing import Any

import pika
import pika.exceptions as pe

from fedmq.broker.transport.base import Broker
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.queues import job_queues
from fedmq.broker.transport.rabbit_consume import RabbitConsuming
from fedmq.broker.transport.rabbit_io import RabbitIo
from fedmq.broker.transport.rabbit_publish import RabbitPublishing
from fedmq.broker.transport.rabbit_reconnect import Reconnection
from fedmq.broker.transport.reassembly import GatedDispatch
from fedmq.broker.transport.tls import TlsOptions, ssl_options
from fedmq.broker.transport.topology import EXCHANGE
from fedmq.broker.transport.urls import addresses, redact
from fedmq.broker.wire.chunk_frames import DEFAULT_CHUNK_LIMIT


class RabbitBroker(RabbitConsuming, RabbitPublishing, RabbitIo, GatedDispatch, Broker):
    """One RabbitMQ connection owned by an I/O thread (see module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        user: str | None = None,
        prefetch: int = 64,
        heartbeat: int = 30,
        chunk_limit: int = DEFAULT_CHUNK_LIMIT,
        tls: TlsOptions | None = None,
        connect_timeout: float = 5.0,
        publish_timeout: float = 300.0,
        max_backoff: float = 5.0,
        max_message_size: int = 4 * 1024**3,
        chunk_timeout_s: float = 600.0,
        consume_timeout: float = 20.0,
        confirm_stall_s: float = 15.0,
    ) -> None:
        self.consume_timeout = consume_timeout  # a subscription the broker has not confirmed by then is stuck
        self.confirm_stall_s = (
            confirm_stall_s  # no confirm for this long: publish the rest again on a new channel
        )
        self.chunk_timeout_s = (
            chunk_timeout_s  # an incomplete chunked message is dropped this long after its last chunk
        )
        self.url = url
        nodes = [self._parameters(a, tls, user, heartbeat, connect_timeout) for a in addresses(url)]
        self._reconnection = Reconnection(nodes, max_backoff)
        self.user = nodes[0].credentials.username
        self.prefetch = prefetch
        self.chunk_limit = chunk_limit
        self.connect_timeout = connect_timeout
        self.publish_timeout = publish_timeout
        self.max_backoff = max_backoff
        self.max_message_size = max_message_size
        self._jobs: list[tuple[str, tuple[str, ...], bool, int]] = []  # (job, agents, inbox, model bytes)
        self._init_io()
        self._init_publishing()
        self._init_consuming()
        self._io.start()
        self._first.wait((connect_timeout * 3 + 5) * len(nodes))
        if self._conn is None:
            self._stopping = True
            self._io.join(timeout=5)
            raise BrokerError(
                f"cannot connect to {redact(url)}: {self._last_error or 'timed out'}", permanent=self._refused
            )
        self._dispatcher.start()

    @staticmethod
    def _parameters(
        url: str, tls: TlsOptions | None, user: str | None, heartbeat: int, connect_timeout: float
    ) -> pika.URLParameters:
        try:
            params = pika.URLParameters(url)
        except Exception as exc:  # pika raises assorted errors on malformed URLs
            raise BrokerError(f"bad broker URL {redact(url)!r}: {exc}", permanent=True) from None
        url_user = params.credentials.username
        if user and user != url_user and "@" in url:
            raise BrokerError(
                f"user {user!r} conflicts with the user {url_user!r} in the broker URL", permanent=True
            )
        if url.lower().startswith("amqps://"):
            params.ssl_options = ssl_options(tls, params.host)
        elif tls is not None:
            raise BrokerError("TLS options given for a plain amqp:// URL: use amqps://", permanent=True)
        params.heartbeat = heartbeat
        params.socket_timeout = connect_timeout
        params.stack_timeout = connect_timeout * 2
        params.blocked_connection_timeout = None
        params.connection_attempts = 1
        return params

    def _restore(self) -> None:
        """After a reconnect: the declared topology again, then every consumer
        (its gate's raw tags are void)."""
        self._reconnects += 1
        for job, agents, inbox, size in list(self._jobs):
            self._declare_now(job, agents, inbox, size)
        for c in list(self._consumers.values()):
            c.gate.reset()
            self._subscribe(c)

    def _declare_now(self, job: str, agents: tuple[str, ...], inbox: bool, model_bytes: int = 0) -> None:
        assert self._conn is not None
        specs = job_queues(job, agents, inbox=inbox, model_bytes=model_bytes)
        ch = self._conn.channel()
        if not inbox:
            # agents lack configure permission on the exchange: check it exists, create it only if allowed
            try:
                ch.exchange_declare(EXCHANGE, exchange_type="topic", passive=True)
            except pe.ChannelClosedByBroker:
                ch = self._conn.channel()
                try:
                    ch.exchange_declare(EXCHANGE, exchange_type="topic", durable=True)
                except pe.ChannelClosedByBroker as exc:
                    raise BrokerError(
                        f"exchange {EXCHANGE!r} does not exist and user {self.user!r} may not create "
                        f"it ({exc.reply_code}): start the aggregator first"
                    ) from None
        try:
            if inbox:
                ch.exchange_declare(EXCHANGE, exchange_type="topic", durable=True)
            for s in specs:
                ch.queue_declare(s.name, durable=True, arguments=s.arguments or None)
                for b in s.bindings:
                    ch.queue_bind(s.name, EXCHANGE, routing_key=b)
        except pe.ChannelClosedByBroker as exc:
            raise BrokerError(
                f"declaring job {job!r} refused by the broker: {exc.reply_code} {exc.reply_text}"
            ) from None
        if ch.is_open:
            ch.close()

    def declare_job(
        self, job: str, agents: list[str] | tuple[str, ...] = (), *, inbox: bool = True, model_bytes: int = 0
    ) -> None:
        agents_t = tuple(agents)
        size = int(model_bytes)
        job_queues(job, agents_t, inbox=inbox)  # validate ids in the caller's thread

        def run(b: RabbitBroker) -> None:
            b._declare_now(job, agents_t, inbox, size)
            if (job, agents_t, inbox, size) not in b._jobs:
                b._jobs.append((job, agents_t, inbox, size))

        self._submit(run, self.publish_timeout, "declaring the job")

    # ---- facts and lifecycle ------------------------------------------------------------------------
    def queue_depth(self, queue: str) -> int:
        def run(b: RabbitBroker) -> int:
            assert b._conn is not None
            ch = b._conn.channel()
            try:
                ok = ch.queue_declare(queue, passive=True)
            except pe.ChannelClosedByBroker as exc:
                if exc.reply_code == 404:
                    return 0
                raise BrokerError(
                    f"cannot read depth of {queue!r}: {exc.reply_code} {exc.reply_text}"
                ) from None
            ch.close()
            return int(ok.method.message_count)

        return self._submit(run, self.publish_timeout, "queue depth")

    def status(self) -> dict[str, Any]:
        with self._lock:
            unconfirmed = sum(1 for c in self._cmds if not c.cancelled and not c.future.done())
        return {
            "url": redact(self.url),
            "user": self.user,
            "connected": self._conn is not None and not self._stopping,
            "blocked": self._blocked,
            "reconnects": self._reconnects,
            "unconfirmed": unconfirmed,
            "consumers": len(self._consumers),
            "last_error": self._last_error,
        }

    def close(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._wake()
        with self._dispatch_cv:
            self._dispatch_cv.notify_all()
        with self._lock:  # a command the broker is not answering keeps the I/O thread (a daemon) for good
            busy = self._wedged or any(c.started is not None and not c.future.done() for c in self._cmds)
        if threading.current_thread() is not self._io:
            self._io.join(timeout=1 if busy else 15)
        if threading.current_thread() is not self._dispatcher and self._dispatcher.is_alive():
            self._dispatcher.join(timeout=15)
