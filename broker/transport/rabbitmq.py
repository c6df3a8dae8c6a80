"""The RabbitMQ backend (``amqp://``, ``amqps://``) on pika's BlockingConnection.

RabbitBroker is made of its responsibilities, each in its own module: the I/O thread that owns the connection
and runs the commands other threads queue (broker.transport.rabbit_io), reconnection and failover across the
nodes of the URL (rabbit_reconnect), publishing with confirms (rabbit_publish), consuming and the dispatcher
thread (rabbit_consume), and pika's private attributes (pika_private, checked at connect). This module puts
them together and holds the job's topology, which is declared again after a reconnect with the consumers.

Each job has its own exchange (``fedmq.<job>``, broker.transport.topology.exchange). The broker watches it:
the aggregator's side (a job declared with its inbox) checks every ``exchange_check_s`` that it exists,
an agent's side too; a missing exchange is one error line naming it. The aggregator's side declares it
again, with its inbox's bindings, once it has been missing for ``3 * exchange_check_s`` (long enough for
every agent's check to have seen it gone); an agent's side binds its own queues again as soon as it is
back. Publishing to it meanwhile fails with that line.

Presence messages (``job.<job>.presence.<client>``) travel on a second connection of the same user, opened
at the first of them, so that a heartbeat never waits behind an upload's chunks on the publishing channel.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pika
import pika.exceptions as pe
import structlog

from fedmq.broker.transport import topology as t
from fedmq.broker.transport.base import Broker
from fedmq.broker.transport.errors import REFUSALS, BrokerError, refusal
from fedmq.broker.transport.queues import job_queues
from fedmq.broker.transport.rabbit_consume import RabbitConsuming
from fedmq.broker.transport.rabbit_io import RabbitIo
from fedmq.broker.transport.rabbit_publish import RabbitPublishing
from fedmq.broker.transport.rabbit_reconnect import Reconnection
from fedmq.broker.transport.reassembly import GatedDispatch
from fedmq.broker.transport.tls import TlsOptions, ssl_options
from fedmq.broker.transport.urls import addresses, redact
from fedmq.broker.wire.chunk_frames import DEFAULT_CHUNK_LIMIT

log = structlog.get_logger(__name__)

EXCHANGE_CHECK_S = 10.0  # how often a broker checks that its jobs' exchanges exist


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
        exchange_check_s: float = EXCHANGE_CHECK_S,
        presence_lane: bool = True,
    ) -> None:
        self.exchange_check_s = exchange_check_s
        self._gone: dict[str, float] = {}  # exchange -> when it was first seen missing
        self._next_check = time.monotonic() + exchange_check_s
        self._watch_ch: Any = None
        self._lane: RabbitBroker | None = None  # presence's own connection (see module docstring)
        self._lane_lock = threading.Lock()
        self._report_missing = True  # a presence lane leaves reporting a missing exchange to its broker
        self._lane_args: dict[str, Any] | None = (
            dict(
                user=user,
                heartbeat=heartbeat,
                tls=tls,
                connect_timeout=connect_timeout,
                publish_timeout=publish_timeout,
                max_backoff=max_backoff,
                exchange_check_s=exchange_check_s,
                presence_lane=False,
            )
            if presence_lane
            else None
        )
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
        ex = t.exchange(job)
        ch = self._conn.channel()
        if not inbox:
            # agents lack configure permission on the exchange: check it exists, create it only if allowed
            try:
                ch.exchange_declare(ex, exchange_type="topic", passive=True)
            except pe.ChannelClosedByBroker:
                ch = self._conn.channel()
                try:
                    ch.exchange_declare(ex, exchange_type="topic", durable=True)
                except pe.ChannelClosedByBroker as exc:
                    raise BrokerError(
                        f"exchange {ex!r} does not exist and user {self.user!r} may not create "
                        f"it ({exc.reply_code}): start the aggregator first"
                    ) from None
        try:
            if inbox:
                ch.exchange_declare(ex, exchange_type="topic", durable=True)
            for s in specs:
                ch.queue_declare(s.name, durable=True, arguments=s.arguments or None)
                for b in s.bindings:
                    ch.queue_bind(s.name, ex, routing_key=b)
        except pe.ChannelClosedByBroker as exc:
            what = f"declaring job {job!r} refused by the broker: {exc.reply_code} {exc.reply_text}"
            if exc.reply_code == 403:
                raise refusal(self.user, f"declare {job}", what) from None
            raise BrokerError(what) from None
        REFUSALS.clear(self.user, f"declare {job}")
        self._gone.pop(ex, None)
        if ch.is_open:
            ch.close()

    # ---- the jobs' exchanges ------------------------------------------------------------------------
    def _vhost(self) -> str:
        return str(self._reconnection.node.virtual_host)

    def _exchange_missing(self, ex: str) -> BrokerError:
        """A publish found ``ex`` gone: one error line (once until it is back), and the watch checks it every
        second from now on."""
        if ex not in self._gone:
            self._gone[ex] = time.monotonic()
            if self._report_missing:
                log.error(t.missing_exchange(ex, self._vhost()), user=self.user)
        self._next_check = min(self._next_check, time.monotonic() + 1.0)
        return BrokerError(t.missing_exchange(ex, self._vhost()))

    def _exchange_exists(self, ex: str) -> bool:
        """A passive declare on a channel kept for it (one round trip); True when unsure."""
        assert self._conn is not None
        if self._watch_ch is None or not self._watch_ch.is_open:
            self._watch_ch = self._conn.channel()
        try:
            self._watch_ch.exchange_declare(ex, exchange_type="topic", passive=True)
            return True
        except pe.ChannelClosedByBroker as exc:
            self._watch_ch = None
            return exc.reply_code != 404

    def _tick(self) -> None:
        """Every ``exchange_check_s`` (every second while one is missing): check the declared jobs'
        exchanges; report a missing one, and declare or bind again (see module docstring)."""
        now = time.monotonic()
        if now < self._next_check or self._conn is None or not self._jobs:
            return
        self._next_check = now + (min(1.0, self.exchange_check_s) if self._gone else self.exchange_check_s)
        by_exchange: dict[str, list[tuple[str, tuple[str, ...], bool, int]]] = {}
        for entry in self._jobs:
            by_exchange.setdefault(t.exchange(entry[0]), []).append(entry)
        for ex, entries in by_exchange.items():
            if self._exchange_exists(ex):
                if ex in self._gone:
                    self._declare_again(ex, entries, "the job's exchange is back: its queues are bound again")
                continue
            if ex not in self._gone:
                self._gone[ex] = now
                log.error(t.missing_exchange(ex, self._vhost()), user=self.user)
            elif any(e[2] for e in entries) and now - self._gone[ex] >= 3 * self.exchange_check_s:
                self._declare_again(ex, entries, "declared the job's missing exchange again")

    def _declare_again(
        self, ex: str, entries: list[tuple[str, tuple[str, ...], bool, int]], what: str
    ) -> None:
        try:
            for job, agents, inbox, size in entries:
                self._declare_now(job, agents, inbox, size)
        except BrokerError as exc:
            log.warning("declaring the job again failed; retrying", exchange=ex, error=str(exc))
            return
        self._gone.pop(ex, None)
        log.warning(what, exchange=ex, vhost=self._vhost())

    # ---- presence on its own connection -------------------------------------------------------------
    def publish(
        self,
        routing_key: str,
        body: bytes,
        *,
        message_id: str | None = None,
        headers: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> None:
        if self._lane_args is not None and isinstance(routing_key, str) and t.is_presence(routing_key):
            lane = self._presence_lane()
            try:
                lane.publish(routing_key, body, message_id=message_id, headers=headers, timeout=timeout)
            except BrokerError:
                ex = t.exchange_for(routing_key)
                if lane._gone.pop(ex, None) is not None:  # reported (once) and watched here
                    raise self._exchange_missing(ex) from None
                raise
            return
        super().publish(routing_key, body, message_id=message_id, headers=headers, timeout=timeout)

    def _presence_lane(self) -> RabbitBroker:
        with self._lane_lock:
            if self._stopping:
                raise BrokerError("the broker connection is closed")
            if self._lane is None:
                assert self._lane_args is not None
                self._lane = RabbitBroker(self.url, **self._lane_args)
                self._lane._report_missing = False
            return self._lane

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
        with self._lane_lock:
            lane, self._lane = self._lane, None
        if lane is not None:
            lane.close()
        self._wake()
        with self._dispatch_cv:
            self._dispatch_cv.notify_all()
        with self._lock:  # a command the broker is not answering keeps the I/O thread (a daemon) for good
            busy = self._wedged or any(c.started is not None and not c.future.done() for c in self._cmds)
        if threading.current_thread() is not self._io:
            self._io.join(timeout=1 if busy else 15)
        if threading.current_thread() is not self._dispatcher and self._dispatcher.is_alive():
            self._dispatcher.join(timeout=15)
