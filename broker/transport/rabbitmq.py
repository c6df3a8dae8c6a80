"""The RabbitMQ backend (``amqp://``, ``amqps://``) on pika's BlockingConnection.

Threading: BlockingConnection is not thread-safe, so one I/O thread owns it. It loops on
``process_data_events`` (heartbeats, consumer deliveries) and runs the commands other threads queue
(publish, ack, reject, declare, consume, cancel, queue depth); a queued command wakes it through
``add_callback_threadsafe``. Callers of publish/declare/consume block on a future; ack/reject do not wait.
Deliveries go to a dispatcher thread that reassembles chunks and runs the handlers, so neither a long
handler nor a long training step on another thread can stop heartbeats.

Publishing: a channel in confirm mode, ``mandatory``, persistent, ``user_id`` = this connection's user.
The chunks of one message are pipelined (up to PIPELINE in flight; each frame is encoded only when sent, from
views of the body, see _publish_frame) and their acks, nacks and returns tracked
per delivery tag; a publish stays at the head of the command queue until every part is confirmed, so after a
lost connection the unconfirmed parts are republished (a duplicate is possible and harmless: chunks are
deduplicated by the reassembler, updates by their id in the aggregator). Nacks are retried until the deadline.

Reconnection: any connection loss (including 320 CONNECTION_FORCED on a broker restart) starts a loop with
exponential backoff (0.2 s doubling, capped at ``max_backoff``, with jitter); once connected the declared
topology is redeclared, the consumers resubscribed and the pending commands resumed. Deliveries from the
old connection can no longer be acked (the broker requeued them); acking them is a logged no-op. A URL with
several addresses (the nodes of one cluster) is tried address by address, starting after the node just lost.
A consumer the broker cancels (its queue's replica went down with a node) is subscribed again, with backoff.
"""

from __future__ import annotations

import collections
import datetime
import random
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

import pika
import pika.exceptions as pe
import structlog

from broker.transport.base import Broker, Delivery, Handler, ReassemblyLimits
from broker.transport.errors import BrokerError
from broker.transport.queues import check_publish_args, job_queues
from broker.transport.reassembly import EXPIRY_CHECK_S, ChunkGate, GatedDispatch
from broker.transport.tls import TlsOptions, ssl_options
from broker.transport.topology import EXCHANGE
from broker.transport.urls import addresses, redact
from broker.wire.chunk_frames import CHUNK_HEADER, DEFAULT_CHUNK_LIMIT, Chunk, ChunkFrame, chunk_parts

log = structlog.get_logger(__name__)

PIPELINE = 8  # chunk messages of one publish in flight before waiting for confirms

_CONNECTION_ERRORS = (pe.AMQPConnectionError, pe.ConnectionClosed, pe.StreamLostError, pe.ConnectionWrongStateError,
                      OSError)


def _noop() -> None:
    pass


@dataclass
class _Cmd:
    fn: Callable[["RabbitBroker"], Any]
    future: Future = field(default_factory=Future)
    cancelled: bool = False
    started: float | None = None  # monotonic time the I/O thread began running it on a live connection
    losses: int = 0  # connections lost while running it


@dataclass
class _Consumer:
    tag: str
    queue: str
    handler: Handler
    prefetch: int
    gate: ChunkGate
    channel: Any = None
    gen: int = -1
    offset: Any = None  # stream queues: x-stream-offset
    only: str | None = None  # hand over only this message id (GatedDispatch._dispatch)


@dataclass
class _Publish:
    routing_key: str
    parts: list[tuple[bytes | Chunk, pika.BasicProperties]]  # a Chunk is encoded when sent
    deadline: float
    message_id: str
    confirmed: set[int] = field(default_factory=set)
    nacked: set[int] = field(default_factory=set)
    returned: bool = False


def _publish_frame(impl: Any, routing_key: str, frame: ChunkFrame, props: pika.BasicProperties) -> None:
    """pika's Channel.basic_publish (check open, send Basic.Publish with the content) minus its ``as_bytes``,
    which would force us to join the frame into one bytes first: pika only takes ``len`` and slices of the
    body, each copied once into a 128 KiB AMQP frame, so a chunk is sent straight from the message body."""
    impl._raise_if_not_open()
    impl._send_method(pika.spec.Basic.Publish(exchange=EXCHANGE, routing_key=routing_key, mandatory=True),
                      (props, frame))


RECV_BYTES = 128 * 1024


def _widen_reads(conn: "pika.BlockingConnection") -> None:
    """Read the socket 128 KiB at a time instead of pika's 4 KiB: consuming model-sized messages spends most of
    its CPU in recv calls otherwise. Private pika attribute (pinned below 2); skipped if it ever moves."""
    transport = getattr(getattr(conn, "_impl", None), "_transport", None)
    if transport is not None and hasattr(transport, "_MAX_RECV_BYTES"):
        transport._MAX_RECV_BYTES = RECV_BYTES


def _refused(exc: BaseException) -> bool:
    """Did the broker refuse the credentials or the virtual host (pika wraps the cause in connector errors)?"""
    while exc is not None:
        if isinstance(exc, (pe.ProbableAuthenticationError, pe.AuthenticationError, pe.ProbableAccessDeniedError)):
            return True
        inner = getattr(exc, "exception", None)
        if inner is None and isinstance(exc, pe.AMQPConnectionError) and exc.args:
            inner = exc.args[0]
        exc = inner if isinstance(inner, BaseException) else None
    return False


class RabbitBroker(GatedDispatch, Broker):
    """One RabbitMQ connection owned by an I/O thread (see module docstring)."""

    def __init__(self, url: str, *, user: str | None = None, prefetch: int = 64, heartbeat: int = 30,
                 chunk_limit: int = DEFAULT_CHUNK_LIMIT, tls: TlsOptions | None = None, connect_timeout: float = 5.0,
                 publish_timeout: float = 300.0, max_backoff: float = 5.0, max_message_size: int = 4 * 1024**3,
                 chunk_timeout_s: float = 600.0, consume_timeout: float = 20.0, confirm_stall_s: float = 15.0) -> None:
        self.consume_timeout = consume_timeout  # a subscription the broker has not confirmed by then is stuck
        self.confirm_stall_s = confirm_stall_s  # no confirm for this long: publish the rest again on a new channel
        self.chunk_timeout_s = chunk_timeout_s  # an incomplete chunked message is dropped this long after its last chunk
        self.url = url
        self._addresses = [self._parameters(a, tls, user, heartbeat, connect_timeout) for a in addresses(url)]
        self._at = 0  # the address tried first: the one last connected to, the next one after losing it
        self._params = self._addresses[0]
        self.user = self._params.credentials.username
        self.prefetch = prefetch
        self.chunk_limit = chunk_limit
        self.connect_timeout = connect_timeout
        self.publish_timeout = publish_timeout
        self.max_backoff = max_backoff
        self.max_message_size = max_message_size

        self._lock = threading.Lock()
        self._cmds: collections.deque[_Cmd] = collections.deque()
        self._conn: pika.BlockingConnection | None = None
        self._pub_ch: Any = None
        self._pub_seq = 0
        self._pub_pending: dict[int, tuple[_Publish, int]] = {}  # delivery tag -> (publish, part)
        self._subscriptions = 0
        self._jobs: list[tuple[str, tuple[str, ...], bool, int]] = []  # (job, agents, inbox, model bytes)
        self._consumers: dict[str, _Consumer] = {}
        self._stopping = False
        self._blocked = False
        self._reconnects = 0
        self._last_error: str | None = None
        self._refused = False  # the broker refused these credentials or this virtual host (not worth retrying)
        self._wedged = False  # the I/O thread is stuck in a call the broker never answers (see consume)
        self._first = threading.Event()
        self._dispatch_q: collections.deque = collections.deque()
        self._dispatch_cv = threading.Condition()
        self._io = threading.Thread(target=self._io_loop, name="fedmq-rabbit-io", daemon=True)
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="fedmq-rabbit-dispatch", daemon=True)
        self._io.start()
        self._first.wait((connect_timeout * 3 + 5) * len(self._addresses))
        if self._conn is None:
            self._stopping = True
            self._io.join(timeout=5)
            raise BrokerError(f"cannot connect to {redact(url)}: {self._last_error or 'timed out'}",
                              permanent=self._refused)
        self._dispatcher.start()

    @staticmethod
    def _parameters(url: str, tls: TlsOptions | None, user: str | None, heartbeat: int,
                    connect_timeout: float) -> pika.URLParameters:
        try:
            params = pika.URLParameters(url)
        except Exception as exc:  # pika raises assorted errors on malformed URLs
            raise BrokerError(f"bad broker URL {redact(url)!r}: {exc}", permanent=True) from None
        url_user = params.credentials.username
        if user and user != url_user and "@" in url:
            raise BrokerError(f"user {user!r} conflicts with the user {url_user!r} in the broker URL", permanent=True)
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

    # ---- I/O thread ---------------------------------------------------------------------------------
    def _connect_any(self) -> "pika.BlockingConnection":
        """A connection to the first address that answers, starting at ``_at``; the last error if none does."""
        error: BaseException | None = None
        n = len(self._addresses)
        for i in range(n):
            k = (self._at + i) % n
            self._params = self._addresses[k]
            try:
                conn = pika.BlockingConnection(self._params)
            except Exception as exc:
                if _refused(exc):
                    raise  # the same users live on every node of a cluster: not worth trying the others
                error = exc
                continue
            self._at = k
            return conn
        assert error is not None
        raise error

    def _open(self) -> None:
        conn = self._connect_any()
        _widen_reads(conn)
        conn.add_on_connection_blocked_callback(self._on_blocked)
        conn.add_on_connection_unblocked_callback(self._on_unblocked)
        self._conn, self._pub_ch = conn, None
        self._blocked = False
        try:
            self._open_pub_channel()
        except Exception:
            self._conn = None
            try:
                conn.close()
            except Exception:
                pass
            raise

    def _describe(self, exc: BaseException) -> str:
        if isinstance(exc, (pe.ProbableAuthenticationError, pe.AuthenticationError)):
            return f"authentication refused for user {self.user!r}"
        if isinstance(exc, pe.ProbableAccessDeniedError):
            return f"access to virtual host {self._params.virtual_host!r} refused for user {self.user!r}"
        inner = getattr(exc, "exception", None)  # pika's connector-phase errors wrap the cause here
        if isinstance(inner, BaseException):
            return self._describe(inner)
        if isinstance(exc, pe.AMQPConnectionError) and exc.args:
            inner = exc.args[0]
            if isinstance(inner, BaseException):
                return self._describe(inner)
            return str(inner) or "connection failed"
        # words for a person, not exception class names
        where = f"{self._params.host}:{self._params.port}"
        if isinstance(exc, socket.gaierror):
            return f"unknown host {self._params.host!r}"
        if isinstance(exc, TimeoutError) or type(exc).__name__ == "AMQPConnectorStackTimeout":
            return f"no answer from {where} (timed out)"
        if isinstance(exc, OSError) and exc.strerror:
            return f"{exc.strerror.lower()} by {where}" if isinstance(exc, ConnectionRefusedError) else \
                f"{exc.strerror.lower()} ({where})"
        return str(exc) or type(exc).__name__

    def _io_loop(self) -> None:
        try:
            self._open()
        except Exception as exc:
            self._last_error = self._describe(exc)
            self._refused = _refused(exc)
            self._first.set()
            return
        self._first.set()
        log.info("connected to RabbitMQ", url=redact(self.url), user=self.user)
        while not self._stopping:
            try:
                if self._conn is None or not self._conn.is_open:
                    self._reconnect()
                    continue
                self._drain()
                if self._stopping:
                    break
                self._conn.process_data_events(time_limit=0.2)
                self._drain()
            except _CONNECTION_ERRORS as exc:
                self._lost(exc)
            except Exception as exc:  # keep the I/O thread alive whatever a callback did
                log.error("unexpected error in the broker I/O thread", error=f"{type(exc).__name__}: {exc}")
                self._lost(exc)
        self._shutdown_io()

    def _lost(self, exc: BaseException) -> None:
        self._last_error = self._describe(exc)
        log.warning("RabbitMQ connection lost; reconnecting", error=self._last_error,
                    node=f"{self._params.host}:{self._params.port}")
        self._at = (self._at + 1) % len(self._addresses)  # a cluster's other nodes first: this one may be down
        self._drop_connection()
        self._pub_ch = None

    def _drop_connection(self) -> None:
        try:
            if self._conn is not None and self._conn.is_open:
                self._conn.close()
        except Exception:  # it is going away anyway
            pass
        self._conn = None

    def _reconnect(self) -> None:
        delay = 0.2
        while not self._stopping:
            try:
                self._open()
            except Exception as exc:
                self._last_error = self._describe(exc)
                sleep = min(self.max_backoff, delay) * random.uniform(0.5, 1.0)
                log.info("reconnect failed; retrying", error=self._last_error, retry_in=round(sleep, 2))
                self._sleep(sleep)
                delay *= 2
                continue
            self._reconnects += 1
            try:
                for job, agents, inbox, size in list(self._jobs):
                    self._declare_now(job, agents, inbox, size)
                for c in list(self._consumers.values()):
                    c.gate.reset()
                    self._subscribe(c)
            except (BrokerError, *_CONNECTION_ERRORS) as exc:
                # e.g. a quorum queue still electing its leader right after a restart: try again
                log.warning("could not restore topology or consumers after reconnect; retrying", error=str(exc))
                self._lost(exc)
                self._sleep(min(self.max_backoff, delay))
                delay *= 2
                continue
            log.info("reconnected to RabbitMQ", reconnects=self._reconnects)
            return

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stopping and time.monotonic() < deadline:
            time.sleep(0.05)

    def _shutdown_io(self) -> None:
        err = BrokerError("the broker connection is closed")
        with self._lock:
            pending = list(self._cmds)
            self._cmds.clear()
        for cmd in pending:
            if not cmd.future.done():
                cmd.future.set_exception(err)
        self._drop_connection()

    def _drain(self) -> None:
        """Run queued commands in order; a command interrupted by a lost connection stays queued."""
        while True:
            with self._lock:
                if not self._cmds:
                    return
                cmd = self._cmds[0]
            if not cmd.cancelled:
                cmd.started = time.monotonic()
                try:
                    result = cmd.fn(self)
                except _CONNECTION_ERRORS:
                    cmd.started = None  # runs again once reconnected
                    cmd.losses += 1
                    raise
                except BrokerError as exc:
                    cmd.future.set_exception(exc)
                except Exception as exc:
                    cmd.future.set_exception(BrokerError(f"{type(exc).__name__}: {exc}"))
                else:
                    cmd.future.set_result(result)
            with self._lock:
                if self._cmds and self._cmds[0] is cmd:
                    self._cmds.popleft()

    def _wake(self) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            conn.add_callback_threadsafe(lambda: None)
        except Exception:
            pass  # closed: the I/O loop drains after reconnecting

    def _submit(self, fn: Callable[["RabbitBroker"], Any], timeout: float | None, what: str,
                stuck: tuple[float, str] | None = None) -> Any:
        """Run ``fn`` on the I/O thread and wait for it, at most ``timeout`` s in all; with ``stuck`` = (s, why),
        at most s once the I/O thread has started it on a live connection, and at most 3 connections lost while
        running it, else a permanent BrokerError that ends with ``why``.

        The wait is sliced, so a signal handler in the calling (main) thread runs within half a second."""
        if self._stopping:
            raise BrokerError("the broker connection is closed")
        if threading.current_thread() is self._io:
            return fn(self)
        cmd = _Cmd(fn)
        with self._lock:
            self._cmds.append(cmd)
        self._wake()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return cmd.future.result(0.5)
            except FutureTimeout:
                now = time.monotonic()
                if stuck is not None and cmd.started is not None and now - cmd.started > stuck[0]:
                    cmd.cancelled = self._wedged = True  # the I/O thread waits inside pika for an answer
                    raise BrokerError(f"RabbitMQ did not confirm {what} within {stuck[0]:.0f} s: {stuck[1]}",
                                      permanent=True) from None
                if stuck is not None and cmd.losses >= 3:
                    cmd.cancelled = True
                    raise BrokerError(f"RabbitMQ closed the connection {cmd.losses} times while {what} "
                                      f"(last: {self._last_error}): {stuck[1]}", permanent=True) from None
                if deadline is not None and now >= deadline:
                    cmd.cancelled = True
                    raise BrokerError(f"{what} not confirmed within {timeout:.0f} s "
                                      f"(connected: {self._conn is not None})") from None

    def _post(self, fn: Callable[["RabbitBroker"], Any]) -> None:
        """Queue a command without waiting (acks and rejects)."""
        with self._lock:
            self._cmds.append(_Cmd(fn))
        self._wake()

    def _on_blocked(self, _conn: Any, frame: Any) -> None:
        self._blocked = True
        reason = getattr(getattr(frame, "method", None), "reason", "")
        log.warning("RabbitMQ blocked this connection (flow control)", reason=reason)

    def _on_unblocked(self, _conn: Any, _frame: Any) -> None:
        self._blocked = False
        log.info("RabbitMQ unblocked this connection")

    # ---- topology -----------------------------------------------------------------------------------
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
                    raise BrokerError(f"exchange {EXCHANGE!r} does not exist and user {self.user!r} may not create "
                                      f"it ({exc.reply_code}): start the aggregator first") from None
        try:
            if inbox:
                ch.exchange_declare(EXCHANGE, exchange_type="topic", durable=True)
            for s in specs:
                ch.queue_declare(s.name, durable=True, arguments=s.arguments or None)
                for b in s.bindings:
                    ch.queue_bind(s.name, EXCHANGE, routing_key=b)
        except pe.ChannelClosedByBroker as exc:
            raise BrokerError(f"declaring job {job!r} refused by the broker: {exc.reply_code} {exc.reply_text}") from None
        if ch.is_open:
            ch.close()

    def declare_job(self, job: str, agents: list[str] | tuple[str, ...] = (), *, inbox: bool = True,
                    model_bytes: int = 0) -> None:
        agents_t = tuple(agents)
        size = int(model_bytes)
        job_queues(job, agents_t, inbox=inbox)  # validate ids in the caller's thread

        def run(b: "RabbitBroker") -> None:
            b._declare_now(job, agents_t, inbox, size)
            if (job, agents_t, inbox, size) not in b._jobs:
                b._jobs.append((job, agents_t, inbox, size))

        self._submit(run, self.publish_timeout, "declaring the job")

    # ---- publishing ---------------------------------------------------------------------------------
    def publish(self, routing_key: str, body: bytes, *, message_id: str | None = None,
                headers: dict[str, Any] | None = None, timeout: float | None = None) -> None:
        check_publish_args(routing_key, body)
        message_id = message_id or uuid.uuid4().hex
        frames = chunk_parts(body if isinstance(body, bytes) else bytes(body), message_id, self.chunk_limit)
        base = dict(headers or {})

        def props(h: dict[str, Any]) -> pika.BasicProperties:
            return pika.BasicProperties(delivery_mode=2, message_id=message_id, user_id=self.user,
                                        headers=h or None, timestamp=int(time.time()))

        if frames is None:
            parts = [(body, props(base))]
        else:
            parts = [(f, props({**base, CHUNK_HEADER: 1})) for f in frames]
        timeout = timeout or self.publish_timeout
        job = _Publish(routing_key, parts, time.monotonic() + timeout, message_id)
        self._submit(lambda b: b._publish_now(job), timeout, f"publish to {routing_key!r}")

    def _open_pub_channel(self) -> Any:
        """A confirm-mode channel whose acks/nacks/returns we track ourselves, so chunks can be pipelined."""
        assert self._conn is not None
        ch = self._conn.channel()
        ready: list[bool] = []
        ch._impl.confirm_delivery(ack_nack_callback=lambda f: self._on_confirm(f),  # looked up per confirm
                                  callback=lambda _f: ready.append(True))
        ch._impl.add_on_return_callback(self._on_return)
        deadline = time.monotonic() + self.connect_timeout * 2
        while not ready:
            if time.monotonic() > deadline or not ch.is_open:
                raise pe.AMQPConnectionError("could not enable publisher confirms")
            self._conn.process_data_events(time_limit=0.05)
        self._pub_ch, self._pub_seq = ch, 0
        self._pub_pending.clear()
        return ch

    def _on_confirm(self, frame: Any) -> None:
        if self._pub_ch is None or frame.channel_number != self._pub_ch.channel_number:
            return  # a late confirm from a channel given up on: its delivery tags are not this channel's
        m = frame.method
        ok = isinstance(m, pika.spec.Basic.Ack)
        seqs = [s for s in self._pub_pending if s <= m.delivery_tag] if m.multiple else [m.delivery_tag]
        for seq in seqs:
            entry = self._pub_pending.pop(seq, None)
            if entry is not None:
                (entry[0].confirmed if ok else entry[0].nacked).add(entry[1])
        self._poke()

    def _poke(self) -> None:
        """Make the running process_data_events return now (a confirm is not an event it waits for)."""
        if self._conn is not None:
            self._conn.call_later(0, _noop)

    def _on_return(self, _ch: Any, _method: Any, props: Any, _body: bytes) -> None:
        for job, _ in self._pub_pending.values():
            if job.message_id == props.message_id:
                job.returned = True
        self._poke()

    def _publish_now(self, job: _Publish) -> None:
        """Publish every unconfirmed part of ``job`` (up to PIPELINE parts in flight) and await their confirms."""
        while True:
            todo = [i for i in range(len(job.parts)) if i not in job.confirmed]
            if not todo:
                return
            ch = self._pub_ch if self._pub_ch is not None and self._pub_ch.is_open else self._open_pub_channel()
            job.nacked.clear()
            assert self._conn is not None
            progress, done = time.monotonic(), len(job.confirmed)
            while todo or any(j is job for j, _ in self._pub_pending.values()):
                inflight = sum(1 for j, _ in self._pub_pending.values() if j is job)
                if todo and inflight < PIPELINE and not job.returned:
                    i = todo.pop(0)
                    data, props = job.parts[i]
                    self._pub_seq += 1
                    self._pub_pending[self._pub_seq] = (job, i)
                    try:
                        if isinstance(data, Chunk):
                            _publish_frame(ch._impl, job.routing_key, ChunkFrame(data), props)
                        else:
                            ch._impl.basic_publish(EXCHANGE, job.routing_key, data, props, mandatory=True)
                    except pe.ChannelWrongStateError:
                        pass  # the channel was closed by the broker: reported below
                    if len(job.parts) > 1:  # write this chunk now, so the broker works on it while we encode the next
                        self._conn.process_data_events(time_limit=0)
                    continue
                if job.returned and inflight == 0:
                    break
                if ch.is_closed:
                    reason = getattr(ch, "_closing_reason", None)
                    self._pub_ch = None
                    self._forget(job)
                    code = getattr(reason, "reply_code", "")
                    raise BrokerError(f"publish to {job.routing_key!r} refused by the broker: {code} "
                                      f"{getattr(reason, 'reply_text', reason)}".replace("  ", " "))
                if time.monotonic() > job.deadline:
                    self._forget(job)
                    raise BrokerError(f"publish to {job.routing_key!r} not confirmed in time")
                if len(job.confirmed) > done:
                    progress, done = time.monotonic(), len(job.confirmed)
                elif time.monotonic() - progress > self.confirm_stall_s and not self._blocked:  # blocked: held
                    self._abandon_pub_channel(job)
                    break
                self._conn.process_data_events(time_limit=0.05)
            if job.returned:
                self._forget(job)
                raise BrokerError(f"message to {job.routing_key!r} is unroutable: no queue is bound to it")
            if job.nacked:
                # transient right after a restart (queue leader not elected yet): retry until the deadline, on a
                # new channel: after a failover a channel can nack every publish to a quorum queue whose leader
                # moved (seen in the 3-node test for over a minute), while a new one reaches the new leader
                if time.monotonic() + 0.5 >= job.deadline:
                    raise BrokerError(f"the broker refused (nacked) the message to {job.routing_key!r}")
                log.info("publish nacked; retrying on a new channel", routing_key=job.routing_key,
                         parts=len(job.nacked))
                self._drop_pub_channel()
                self._conn.sleep(0.5)

    def _abandon_pub_channel(self, job: _Publish) -> None:
        """No confirm for confirm_stall_s on a live connection: a confirm lost in a quorum queue's leader change
        would otherwise hold the I/O thread (and every command behind this one) until the publish deadline.
        The unconfirmed parts go out again on a new channel: at least once, and receivers drop duplicates by
        message id (chunks by message id and index)."""
        log.warning("publish not confirmed; publishing again on a new channel", routing_key=job.routing_key,
                    unconfirmed=len(job.parts) - len(job.confirmed), after_s=self.confirm_stall_s)
        self._forget(job)
        self._drop_pub_channel()

    def _drop_pub_channel(self) -> None:
        """Close the publishing channel without waiting for close-ok (the broker's side may be the stuck part);
        the next publish opens a new one. Confirms still arriving on it are ignored (see _on_confirm)."""
        ch, self._pub_ch = self._pub_ch, None
        if ch is None:
            return
        try:
            ch._impl.close()
        except Exception:  # already closing or closed
            pass

    def _forget(self, job: _Publish) -> None:
        for seq in [s for s, (j, _) in self._pub_pending.items() if j is job]:
            del self._pub_pending[seq]

    # ---- consuming ----------------------------------------------------------------------------------
    def _subscribe(self, c: _Consumer) -> None:
        assert self._conn is not None
        ch = self._conn.channel()
        ch.basic_qos(prefetch_count=c.prefetch)
        self._subscriptions += 1
        gen = self._subscriptions  # deliveries of an earlier subscription (or connection) can no longer be settled

        def on_message(_ch: Any, method: Any, props: Any, body: bytes) -> None:
            d = Delivery(body=body, routing_key=method.routing_key, queue=c.queue, message_id=props.message_id,
                         user_id=props.user_id, headers=dict(props.headers or {}), redelivered=method.redelivered,
                         tag=(gen, c.tag, method.delivery_tag))
            with self._dispatch_cv:
                self._dispatch_q.append((c, d))
                self._dispatch_cv.notify()

        ch.add_on_cancel_callback(lambda _frame: self._on_cancelled(c, ch))
        args = None
        if c.offset is not None:  # a timestamp travels as an AMQP timestamp, which pika writes for a datetime
            off = c.offset
            if isinstance(off, float):
                off = datetime.datetime.fromtimestamp(int(off), tz=datetime.timezone.utc)
            args = {"x-stream-offset": off}
        try:
            ch.basic_consume(c.queue, on_message, auto_ack=False, consumer_tag=c.tag, arguments=args)
        except pe.ChannelClosedByBroker as exc:
            raise BrokerError(f"cannot consume {c.queue!r}: {exc.reply_code} {exc.reply_text}") from None
        c.channel, c.gen = ch, gen

    def _on_cancelled(self, c: _Consumer, ch: Any) -> None:
        """The broker cancelled a consumer (its queue's member on a lost node, a deleted queue): subscribe again,
        with backoff, for as long as the consumer is wanted."""
        if self._consumers.get(c.tag) is not c or c.channel is not ch:
            return
        log.warning("the broker cancelled a consumer; subscribing again", queue=c.queue)
        self._resubscribe(c, 0.5)

    def _resubscribe(self, c: _Consumer, delay: float) -> None:
        conn = self._conn

        def again() -> None:
            if self._consumers.get(c.tag) is not c or self._conn is not conn:
                return  # cancelled meanwhile, or a reconnect subscribed it again
            if c.channel is not None and c.channel.is_open:
                c.channel.close()  # gives back what the cancelled consumer held
            c.gate.reset()
            try:
                self._subscribe(c)
            except BrokerError as exc:
                log.warning("subscribing again failed; retrying", queue=c.queue, error=str(exc))
                self._resubscribe(c, min(delay * 2, self.max_backoff))

        if conn is not None:
            conn.call_later(delay, again)

    def consume(self, queue: str, handler: Handler, *, prefetch: int | None = None, offset: Any = None,
                only_message: str | None = None, reassembly: ReassemblyLimits | None = None) -> str:
        window = prefetch or self.prefetch
        if offset is not None and not isinstance(offset, (int, float, str)) or isinstance(offset, bool):
            raise BrokerError(f"bad stream offset {offset!r}: use an int, first, last, next or a timestamp")
        c = _Consumer(f"fedmq-{uuid.uuid4().hex[:12]}", queue, handler, window,
                      ChunkGate.of(window, reassembly or ReassemblyLimits(max_message_size=self.max_message_size),
                                   self.chunk_timeout_s), offset=offset, only=only_message)

        def run(b: "RabbitBroker") -> str:
            b._subscribe(c)
            b._consumers[c.tag] = c
            return c.tag

        # RabbitMQ 3.10 answers a consume at once, or never: a quorum queue whose node was killed within about a
        # second of declaring it comes back as a zombie (declarable, 0 messages, no consume or get ever answered)
        zombie = (f"probably a zombie quorum queue (its node was killed within seconds of declaring it; its "
                  f"messages are lost); delete it (rabbitmqctl delete_queue {queue}) and start again")
        return self._submit(run, self.publish_timeout, f"consuming {queue!r}", stuck=(self.consume_timeout, zombie))

    def cancel(self, consumer_tag: str) -> None:
        def run(b: "RabbitBroker") -> None:
            c = b._consumers.pop(consumer_tag, None)
            if c is not None and c.channel is not None and c.channel.is_open:
                c.channel.close()  # closing the channel requeues its unacked deliveries

        self._submit(run, self.publish_timeout, "cancelling a consumer")

    def _settle_raw(self, raw: tuple[int, str, int], requeue: bool | None) -> None:
        gen, tag, delivery_tag = raw

        def run(b: "RabbitBroker") -> None:
            c = b._consumers.get(tag)
            if c is None or gen != c.gen or c.channel is None or not c.channel.is_open:
                log.debug("ack/reject of a delivery from a previous connection ignored (it was requeued)")
                return
            if requeue is None:
                c.channel.basic_ack(delivery_tag)
            else:
                c.channel.basic_reject(delivery_tag, requeue=requeue)

        if threading.current_thread() is self._io:
            run(self)
        else:
            self._post(run)

    def _dispatch_loop(self) -> None:
        last_expiry = time.monotonic()
        while True:
            last_expiry = self._expire_due(last_expiry)
            with self._dispatch_cv:
                if not self._dispatch_q and not self._stopping:
                    self._dispatch_cv.wait(timeout=EXPIRY_CHECK_S)
                if self._stopping:
                    return  # unacked deliveries go back to the queue when the connection closes
                item = self._dispatch_q.popleft() if self._dispatch_q else None
            if item is None:
                continue
            c, raw = item
            if c.tag not in self._consumers or raw.tag[0] != c.gen:
                continue  # cancelled, or from a lost connection (requeued by the broker)
            self._dispatch(c, raw)

    # ---- facts and lifecycle ------------------------------------------------------------------------
    def queue_depth(self, queue: str) -> int:
        def run(b: "RabbitBroker") -> int:
            assert b._conn is not None
            ch = b._conn.channel()
            try:
                ok = ch.queue_declare(queue, passive=True)
            except pe.ChannelClosedByBroker as exc:
                if exc.reply_code == 404:
                    return 0
                raise BrokerError(f"cannot read depth of {queue!r}: {exc.reply_code} {exc.reply_text}") from None
            ch.close()
            return int(ok.method.message_count)

        return self._submit(run, self.publish_timeout, "queue depth")

    def status(self) -> dict[str, Any]:
        with self._lock:
            unconfirmed = sum(1 for c in self._cmds if not c.cancelled and not c.future.done())
        return {"url": redact(self.url), "user": self.user, "connected": self._conn is not None and not self._stopping,
                "blocked": self._blocked, "reconnects": self._reconnects, "unconfirmed": unconfirmed,
                "consumers": len(self._consumers), "last_error": self._last_error}

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
