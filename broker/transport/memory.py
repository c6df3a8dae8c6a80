"""The in-process broker (``memory://NAME``) for `fedmq simulate` and fast tests.

Keeps the RabbitMQ semantics fedmq relies on: a topic exchange per job (``fedmq.<job>``, declared with the
job; a publish goes to the exchange its routing key names, and to a missing one fails naming it) with
``*``/``#`` routing, ``mandatory``
(unroutable publishes fail), per-queue FIFO, per-consumer prefetch, unacked messages requeued (in their
original order, flagged ``redelivered``) when their consumer is cancelled or its connection closes,
``x-max-length`` with drop-head (only ready messages count, like RabbitMQ), single active consumer, and
stream queues (``x-queue-type: stream``): an append-only log that consumers read from an ``offset`` (a
number, "first", "last", "next" or a POSIX timestamp) without removing anything, every delivery carrying its
``x-stream-offset`` header, retention by ``x-max-length-bytes`` (whole messages, oldest first; RabbitMQ drops
whole segments, so it keeps at least as much), and a quorum queue's ``x-delivery-limit`` with
``x-dead-letter-exchange``/``-routing-key`` (a message returned more than the limit, or rejected without
requeue, is routed to the dead-letter key; no ``x-death`` header), and publisher flow control (a publish
into a queue that holds ``FLOW_BYTES`` of ready messages while it has a consumer waits until the consumer has
taken some: RabbitMQ's credit flow slows a publisher to its queue's pace, so a backlog of updates cannot grow
without bound in the aggregator's own process). Every ``connect("memory://NAME")`` in the
process shares the hub NAME; each is one "connection" with its own dispatcher thread that runs the handlers,
so a slow handler blocks only its own connection's consumers.
"""

from __future__ import annotations

import bisect
import itertools
import queue as queue_mod
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from fedmq.broker.transport import topology as t
from fedmq.broker.transport.base import PREFETCH, Broker, Delivery, Handler, ReassemblyLimits
from fedmq.broker.transport.errors import BrokerError, Undeliverable
from fedmq.broker.transport.queues import check_publish_args, job_queues
from fedmq.broker.transport.reassembly import EXPIRY_CHECK_S, ChunkGate, GatedDispatch
from fedmq.broker.wire.chunk_frames import CHUNK_HEADER, DEFAULT_CHUNK_LIMIT, chunk_messages

log = structlog.get_logger(__name__)

# Ready bytes above which a publish into a consumed queue waits (module docstring): a few updates of a 10 M
# parameter model, so the consumer never waits for lack of work.
FLOW_BYTES = 64 * 1024**2
FLOW_CHECK_S = 1.0  # a waiting publisher looks again this often (its connection may have closed)


def _exchange_of(key: str) -> str | None:
    """The exchange of a routing key or binding pattern: its job's (None for a key of no job)."""
    job = t.job_of_key(key)
    return None if job is None else t.exchange(job)


def topic_matches(pattern: str, key: str) -> bool:
    """AMQP topic matching: words split on '.', '*' is exactly one word, '#' is zero or more words."""
    return _match(pattern.split("."), key.split("."))


def _match(p: list[str], k: list[str]) -> bool:
    if not p:
        return not k
    head = p[0]
    if head == "#":
        return any(_match(p[1:], k[i:]) for i in range(len(k) + 1))
    if not k:
        return False
    return (head == "*" or head == k[0]) and _match(p[1:], k[1:])


@dataclass
class _Msg:
    seq: int
    routing_key: str
    body: bytes
    message_id: str | None
    user_id: str | None
    headers: dict[str, Any]
    redelivered: bool = False
    returns: int = 0  # times given back to its queue (RabbitMQ's quorum-queue delivery count)


@dataclass
class _Consumer:
    tag: str
    queue: _Queue
    conn: MemoryBroker
    handler: Handler
    prefetch: int
    gate: ChunkGate
    unacked: dict[int, _Msg] = field(default_factory=dict)
    cancelled: bool = False
    only: str | None = None  # deliver only the messages with this message id (the others are acked unseen)
    cursor: int = 0  # stream queues: the offset of the next message to deliver


@dataclass
class _Queue:
    name: str
    arguments: dict[str, Any]
    ready: list[_Msg] = field(default_factory=list)  # sorted by seq
    consumers: list[_Consumer] = field(default_factory=list)
    rr: int = 0
    ready_bytes: int = 0

    def push(self, msg: _Msg) -> None:
        self.ready.append(msg)
        self.ready_bytes += len(msg.body)
        limit = self.arguments.get("x-max-length")
        if limit is not None:
            while len(self.ready) > int(limit):
                dropped = self.take()
                log.debug(
                    "max-length queue dropped its oldest message",
                    queue=self.name,
                    message_id=dropped.message_id,
                )

    def take(self) -> _Msg:
        """The oldest ready message, removed."""
        msg = self.ready.pop(0)
        self.ready_bytes -= len(msg.body)
        return msg

    def crowded(self) -> bool:
        """Publishers into this queue wait (FLOW_BYTES): it holds that much ready and has a consumer to take
        it, and the publishing thread is not one of its consumers' dispatchers (it would wait for itself)."""
        if self.ready_bytes < FLOW_BYTES or not self.consumers:
            return False
        me = threading.current_thread()
        return all(c.conn._thread is not me for c in self.consumers)

    def requeue(self, msgs: list[_Msg]) -> list[_Msg]:
        """Give ``msgs`` back; those returned more than the queue's ``x-delivery-limit`` times are not
        requeued but returned (to be dead-lettered), as a RabbitMQ quorum queue does."""
        limit = self.arguments.get("x-delivery-limit")
        over = []
        for m in msgs:
            m.redelivered = True
            m.returns += 1
            if limit is not None and m.returns > int(limit):
                over.append(m)
            else:
                bisect.insort(self.ready, m, key=lambda x: x.seq)
                self.ready_bytes += len(m.body)
        return over


@dataclass
class _Stream(_Queue):
    """A stream queue: ``log`` holds (offset, time, message); nothing is removed by consuming."""

    log: list[tuple[int, float, _Msg]] = field(default_factory=list)
    next_offset: int = 0
    nbytes: int = 0

    def push(self, msg: _Msg) -> None:
        self.log.append((self.next_offset, time.time(), msg))
        self.next_offset += 1
        self.nbytes += len(msg.body)
        limit = self.arguments.get("x-max-length-bytes")
        while limit is not None and self.nbytes > int(limit) and len(self.log) > 1:
            self.nbytes -= len(self.log.pop(0)[2].body)

    def requeue(self, msgs: list[_Msg]) -> list[_Msg]:
        """Nothing to requeue: a stream keeps every message until retention drops it."""
        return []

    def crowded(self) -> bool:
        """Never: a stream is read, not drained, and retention bounds it."""
        return False

    def start(self, offset: Any) -> int:
        """The first offset a new consumer reads, for an ``x-stream-offset`` value (default "next")."""
        first = self.log[0][0] if self.log else self.next_offset
        if offset is None or offset == "next":
            return self.next_offset
        if offset == "first":
            return first
        if offset == "last":
            return self.log[-1][0] if self.log else self.next_offset
        if isinstance(offset, int) and not isinstance(offset, bool):
            return max(offset, first)
        if isinstance(offset, float):  # a POSIX timestamp: the first message stored at or after it
            for off, stamp, _ in self.log:
                if stamp >= offset:
                    return off
            return self.next_offset
        raise BrokerError(f"bad stream offset {offset!r}: use an int, first, last, next or a timestamp")

    def read(self, cursor: int) -> tuple[int, _Msg] | None:
        """The message at ``cursor`` or the first retained one after it, with its offset."""
        if not self.log or cursor >= self.next_offset:
            return None
        i = max(0, cursor - self.log[0][0])
        off, _, msg = self.log[i]
        return off, msg


class _Hub:
    """One named in-process broker: queues, bindings of its topic exchange, and a lock around all of it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.RLock()
        self.drained = threading.Condition(self.lock)  # told when ready messages leave a queue
        self.queues: dict[str, _Queue] = {}
        # (exchange, pattern, queue): a binding's exchange is its pattern's job's (None: a key of no job)
        self.bindings: list[tuple[str | None, str, str]] = []
        self.exchanges: set[str] = set()
        self.seq = itertools.count()
        self.delivery_ids = itertools.count(1)
        self._routes: dict[str, list[str]] = {}

    def declare(self, name: str, arguments: dict[str, Any], bindings: tuple[str, ...]) -> None:
        with self.lock:
            q = self.queues.get(name)
            if q is None:
                kind = _Stream if arguments.get("x-queue-type") == "stream" else _Queue
                self.queues[name] = kind(name, dict(arguments))
                self._routes.clear()
            elif q.arguments != arguments:
                raise BrokerError(
                    f"queue {name} exists with different arguments {q.arguments} (wanted {arguments})"
                )
            for b in bindings:
                binding = (_exchange_of(b), b, name)
                if binding not in self.bindings:
                    self.bindings.append(binding)
                    self._routes.clear()

    def declare_exchange(self, name: str) -> None:
        with self.lock:
            self.exchanges.add(name)

    def delete_exchange(self, name: str) -> None:
        """Delete an exchange and every binding on it (as RabbitMQ's exchange.delete does)."""
        with self.lock:
            self.exchanges.discard(name)
            self.bindings = [b for b in self.bindings if b[0] != name]
            self._routes.clear()

    def delete_queues(self, prefix: str) -> list[str]:
        """Delete every queue whose name starts with ``prefix``, with its bindings; the names deleted."""
        with self.lock:
            gone = [name for name in self.queues if name.startswith(prefix)]
            for name in gone:
                del self.queues[name]
            self.drained.notify_all()
            self.bindings = [(e, p, q) for e, p, q in self.bindings if q not in gone]
            self._routes.clear()
            return gone

    def route(self, routing_key: str) -> list[_Queue]:
        """The queues bound to ``routing_key``, cached per key: a federation of K agents has 2K bindings, and
        every heartbeat is a publish (the cache is cleared when a queue or binding is added)."""
        names = self._routes.get(routing_key)
        if names is None:
            ex = _exchange_of(routing_key)
            if ex is not None and ex not in self.exchanges:
                raise BrokerError(t.missing_exchange(ex))
            names = self._routes[routing_key] = [
                q for e, p, q in self.bindings if e == ex and topic_matches(p, routing_key)
            ]
        return [self.queues[q] for q in names if q in self.queues]

    def dead_letter(self, q: _Queue, msgs: list[_Msg]) -> None:
        """Route ``msgs`` (rejected, or over the delivery limit) to ``q``'s dead-letter routing key, if it has
        one; else they are dropped (caller holds the lock)."""
        rk = q.arguments.get("x-dead-letter-routing-key")
        if rk is None or "x-dead-letter-exchange" not in q.arguments:
            return
        try:
            targets = self.route(rk)
        except BrokerError:  # its exchange is gone: RabbitMQ drops such a dead letter too
            return
        for m in msgs:
            for target in targets:
                target.push(replace(m, seq=next(self.seq), routing_key=rk, redelivered=False, returns=0))
                self.pump(target)

    def pump(self, q: _Queue) -> None:
        """Hand ready messages to consumers with room in their prefetch window (caller holds the lock)."""
        if isinstance(q, _Stream):
            self._pump_stream(q)
            return
        sac = bool(q.arguments.get("x-single-active-consumer"))
        while q.ready and q.consumers:
            candidates = q.consumers[:1] if sac else q.consumers
            chosen = None
            for i in range(len(candidates)):
                c = candidates[(q.rr + i) % len(candidates)]
                if len(c.unacked) < c.prefetch:
                    chosen = c
                    q.rr = (q.rr + i + 1) % max(1, len(candidates))
                    break
            if chosen is None:
                return
            msg = q.take()
            self._hand(chosen, msg, dict(msg.headers), msg.redelivered)
            self.drained.notify_all()

    def _pump_stream(self, q: _Stream) -> None:
        for c in q.consumers:
            while len(c.unacked) < c.prefetch:
                item = q.read(c.cursor)
                if item is None:
                    break
                off, msg = item
                c.cursor = off + 1
                self._hand(c, msg, {**msg.headers, "x-stream-offset": off}, False)

    def _hand(self, c: _Consumer, msg: _Msg, headers: dict[str, Any], redelivered: bool) -> None:
        """Deliver ``msg`` to ``c``'s connection, unacked under a new delivery id."""
        did = next(self.delivery_ids)
        c.unacked[did] = msg
        d = Delivery(
            body=msg.body,
            routing_key=msg.routing_key,
            queue=c.queue.name,
            message_id=msg.message_id,
            user_id=msg.user_id,
            headers=headers,
            redelivered=redelivered,
            tag=(c, did),
        )
        c.conn._inbox.put((c, d))


_hubs: dict[str, _Hub] = {}
_hubs_lock = threading.Lock()


def hub(name: str) -> _Hub:
    with _hubs_lock:
        h = _hubs.get(name)
        if h is None:
            h = _hubs[name] = _Hub(name)
        return h


class MemoryBroker(Broker):
    """One connection to the in-process hub ``name`` (see module docstring)."""

    def __init__(
        self,
        name: str,
        *,
        user: str = "guest",
        prefetch: int = PREFETCH,
        chunk_limit: int = DEFAULT_CHUNK_LIMIT,
        max_message_size: int = 4 * 1024**3,
        chunk_timeout_s: float = 600.0,
    ) -> None:
        self.url = f"memory://{user}@{name}"
        self.user = user
        self.prefetch = prefetch
        self.chunk_limit = chunk_limit
        self.max_message_size = max_message_size
        self.chunk_timeout_s = (
            chunk_timeout_s  # an incomplete chunked message is dropped this long after its last chunk
        )
        self._hub = hub(name)
        self._consumers: dict[str, _Consumer] = {}
        self._gates = GatedDispatch(self._consumers, self._settle_raw)
        self._closed = False
        self._inbox: queue_mod.Queue = queue_mod.Queue()
        self._thread = threading.Thread(
            target=self._dispatch_loop, name=f"fedmq-memory-dispatch-{name}", daemon=True
        )
        self._thread.start()

    def purge_job(self, job: str) -> list[str]:
        """Delete the job's queues from this hub (provision.purge's counterpart); the names deleted. The hub
        lives as long as the process: a simulation purges its job at the end, so a later run of the same job
        does not read this one's leftovers (its agents' goodbyes would look like the new run's selected agents
        leaving)."""
        return self._hub.delete_queues(f"fedmq.{job}.")

    # ---- publishing ---------------------------------------------------------------------------------
    def declare_job(
        self,
        job: str,
        agents: list[str] | tuple[str, ...] = (),
        *,
        inbox: bool = True,
        model_bytes: int = 0,
        edges: tuple[int, ...] = (),
    ) -> None:
        self._check_open()
        specs = job_queues(job, agents, inbox=inbox, model_bytes=model_bytes, edges=tuple(edges))
        self._hub.declare_exchange(t.exchange(job))
        for spec in specs:
            self._hub.declare(spec.name, spec.arguments, spec.bindings)

    def publish(
        self,
        routing_key: str,
        body: bytes,
        *,
        message_id: str | None = None,
        headers: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> None:
        self._check_open()
        check_publish_args(routing_key, body)
        message_id = message_id or uuid.uuid4().hex
        base_headers = dict(headers or {})
        frames = chunk_messages(bytes(body), message_id, self.chunk_limit)
        parts = (
            [(bytes(body), base_headers)]
            if frames is None
            else [(f, {**base_headers, CHUNK_HEADER: 1}) for f in frames]
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._hub.lock:
            targets = self._hub.route(routing_key)
            while any(q.crowded() for q in targets) and not self._closed:  # flow control (module docstring)
                left = FLOW_CHECK_S if deadline is None else min(FLOW_CHECK_S, deadline - time.monotonic())
                if left <= 0:
                    raise BrokerError(
                        f"publish to {routing_key!r} not taken within {timeout:g} s: its queue holds "
                        f"{FLOW_BYTES // 2**20} MiB its consumer has not taken"
                    )
                self._hub.drained.wait(left)
                targets = self._hub.route(routing_key)
            self._check_open()
            if not targets:
                raise Undeliverable(f"message to {routing_key!r} is unroutable: no queue is bound to it")
            for data, hdrs in parts:
                seq = next(self._hub.seq)
                for q in targets:
                    q.push(_Msg(seq, routing_key, data, message_id, self.user, dict(hdrs)))
            for q in targets:
                self._hub.pump(q)

    # ---- consuming ----------------------------------------------------------------------------------
    def consume(
        self,
        queue: str,
        handler: Handler,
        *,
        prefetch: int | None = None,
        offset: Any = None,
        only_message: str | None = None,
        reassembly: ReassemblyLimits | None = None,
    ) -> str:
        self._check_open()
        window = prefetch or self.prefetch
        gate = ChunkGate.of(
            window,
            reassembly or ReassemblyLimits(max_message_size=self.max_message_size),
            self.chunk_timeout_s,
        )
        with self._hub.lock:
            q = self._hub.queues.get(queue)
            if q is None:
                raise BrokerError(f"cannot consume {queue!r}: no such queue (declare the job first)")
            tag = f"memory-{uuid.uuid4().hex[:12]}"
            c = _Consumer(tag, q, self, handler, window, gate, only=only_message)
            if isinstance(q, _Stream):
                c.cursor = q.start(offset)
            elif offset is not None:
                raise BrokerError(f"cannot consume {queue!r} from an offset: it is not a stream")
            q.consumers.append(c)
            self._consumers[tag] = c
            self._hub.pump(q)
        return tag

    def cancel(self, consumer_tag: str) -> None:
        with self._hub.lock:
            c = self._consumers.pop(consumer_tag, None)
            if c is None:
                return
            c.cancelled = True
            if c in c.queue.consumers:
                c.queue.consumers.remove(c)
            self._hub.dead_letter(c.queue, c.queue.requeue(list(c.unacked.values())))
            c.unacked.clear()
            self._hub.pump(c.queue)
            self._hub.drained.notify_all()  # a publisher waiting on this consumer looks again

    def ack(self, delivery: Delivery) -> None:
        self._gates.settle(delivery, None)

    def reject(self, delivery: Delivery, *, requeue: bool = False) -> None:
        self._gates.settle(delivery, requeue)

    def _settle_raw(self, raw: tuple[_Consumer, int], requeue: bool | None) -> None:
        """requeue None = ack; False = reject and drop; True = reject and requeue."""
        c, did = raw
        with self._hub.lock:
            msg = c.unacked.pop(did, None)
            if msg is None:
                return  # consumer was cancelled: already requeued
            if requeue is not None:  # rejected: requeued (up to the delivery limit) or dead-lettered
                self._hub.dead_letter(c.queue, c.queue.requeue([msg]) if requeue else [msg])
            self._hub.pump(c.queue)

    def _dispatch_loop(self) -> None:
        """Runs the handlers. It wakes for expiry checks only while some consumer holds chunks of an
        incomplete message: a simulation has a connection per agent, and idle ones must cost no CPU."""
        last_expiry = time.monotonic()
        while True:
            last_expiry = self._gates.expire_due(last_expiry)
            holding = any(c.gate.holding() for c in list(self._consumers.values()))
            try:
                item = self._inbox.get(timeout=EXPIRY_CHECK_S if holding else None)
            except queue_mod.Empty:
                continue
            if item is None:
                return
            c, raw = item
            if c.cancelled:
                continue  # its unacked messages were requeued on cancel
            self._gates.dispatch(c, raw)

    # ---- facts and lifecycle ------------------------------------------------------------------------
    def queue_depth(self, queue: str) -> int:
        with self._hub.lock:
            q = self._hub.queues.get(queue)
            return len(q.ready) if q is not None else 0

    def status(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "user": self.user,
            "connected": not self._closed,
            "blocked": False,
            "reconnects": 0,
            "unconfirmed": 0,
            "consumers": len(self._consumers),
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for tag in list(self._consumers):
            self.cancel(tag)
        self._inbox.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerError("the broker connection is closed")
