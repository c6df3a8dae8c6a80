"""Reassembly of chunked messages on the consuming side, for every Broker backend.

A body over the chunk limit is published as several messages carrying the header ``x-fedmq-chunk`` whose
bodies are chunk frames (the format: broker.wire.chunk_frames). :class:`Reassembler` joins the frames of many
messages into their bodies within memory bounds; each consumer owns a :class:`ChunkGate` that feeds it the raw
deliveries of its queue and turns them into whole deliveries for the handler.

Acks: chunk deliveries are *held* unacked until the whole message is handed over, and acking that one
Delivery acks every chunk (so a consumer that dies mid-message gets all chunks redelivered elsewhere).
Prefetch would deadlock when a message has more chunks than the window still free, so when the
consumer's unsettled deliveries reach the window while chunks are held, the held chunks are acked early
("window-full"). Those chunks then live only in this process: a broker restart or reconnect is harmless
(the reassembler keeps them and redelivered copies are acked as duplicates), a crash of the consumer
process loses that partial message. Keep prefetch above chunks-per-message to avoid this path.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from fedmq.broker.transport.base import REFUSED_SIZE_HEADER, Delivery, Handler, ReassemblyLimits
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.wire.blobs import digest
from fedmq.broker.wire.chunk_frames import (
    CHUNK_HEADER,
    FRAME_OVERHEAD,
    Chunk,
    byte_view,
    chunk_size,
    decode_chunk,
)
from fedmq.errors import CodecError

log = structlog.get_logger(__name__)


@dataclass
class _Pending:
    total: int
    total_size: int
    digest: bytes
    chunk_size: int
    parts: dict[int, bytes | memoryview]  # index -> data (views of the frames, not copies)
    last_seen: float
    sender: str | None = None


class Reassembler:
    """Collects chunks of many messages at once and returns each body once all its chunks arrived.

    Memory: ``total_size`` bytes are reserved per incomplete message once the limits are checked
    (``pending_bytes`` is their sum); its chunks' data are kept as they came (views of the frames) and
    joined into the body, the one copy on this side, when the last one arrives. An incomplete message is
    dropped ``timeout_s`` after its most recent chunk (checked on every ``add`` and by ``expire``). Ids of
    finished messages (completed or rejected) are remembered for ``timeout_s`` so late duplicates do not start
    a new partial message. ``max_pending_per_sender`` (optional) bounds the reserved bytes of one ``sender``
    (the aggregator passes each delivery's routing key, which names the agent),
    so one sender cannot take the whole budget. Thread-safe.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 300.0,
        max_pending_bytes: int = 2 * 1024**3,
        max_message_size: int = 1024**3,
        max_finished: int = 100_000,
        max_pending_per_sender: int | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_pending_bytes = max_pending_bytes
        self.max_pending_per_sender = max_pending_per_sender
        self._by_sender: dict[str | None, int] = {}  # sender -> bytes reserved by its incomplete messages
        self.max_message_size = max_message_size
        self.max_finished = max_finished
        self._pending: dict[str, _Pending] = {}
        self._finished: OrderedDict[str, tuple[float, bool]] = OrderedDict()  # msg_id -> (when, completed ok)
        self._bytes = 0
        self._lock = threading.Lock()

    def add(self, chunk: Chunk, now: float | None = None, sender: str | None = None) -> bytes | None:
        """Add one chunk; the whole body when the message is complete, else None (also for a duplicate)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._expire_locked(now)
            done = self._finished.get(chunk.msg_id)
            if done is not None:
                if done[1]:
                    return None  # late duplicate of a delivered message
                raise CodecError("message-dropped", f"message {chunk.msg_id} was already rejected")
            p = self._pending.get(chunk.msg_id)
            if p is None:
                p = self._start(chunk, now, sender)
                if p is None:
                    return self._finish(
                        chunk.msg_id,
                        byte_view(chunk.data).tobytes() if not isinstance(chunk.data, bytes) else chunk.data,
                        chunk.digest,
                        now,
                    )
            else:
                if (chunk.total, chunk.total_size, chunk.digest) != (p.total, p.total_size, p.digest):
                    self._fail(chunk.msg_id, now)
                    raise CodecError(
                        "inconsistent-chunk",
                        f"chunk {chunk.index} of {chunk.msg_id} disagrees with earlier chunks",
                    )
                if chunk.index in p.parts:
                    p.last_seen = now
                    return None
            expected = min(p.chunk_size, p.total_size - chunk.index * p.chunk_size)
            data = chunk.data if isinstance(chunk.data, bytes) else byte_view(chunk.data)
            if len(data) != expected:
                self._fail(chunk.msg_id, now)
                raise CodecError(
                    "inconsistent-chunk",
                    f"chunk {chunk.index} of {chunk.msg_id} has {len(data)} bytes, want {expected}",
                )
            p.parts[chunk.index] = data
            p.last_seen = now
            if len(p.parts) < p.total:
                return None
            self._release(chunk.msg_id)
            return self._finish(chunk.msg_id, b"".join(p.parts[i] for i in range(p.total)), p.digest, now)

    def _start(self, chunk: Chunk, now: float, sender: str | None) -> _Pending | None:
        """Check limits for a new message; None when it is a single chunk (no buffer needed)."""
        if chunk.total_size > self.max_message_size:
            self._remember(chunk.msg_id, now, False)
            raise CodecError(
                "too-large",
                f"message {chunk.msg_id} of {chunk.total_size} bytes exceeds {self.max_message_size}",
            )
        try:
            cs = chunk_size(chunk)
        except CodecError:
            self._remember(chunk.msg_id, now, False)
            raise
        if chunk.total == 1:
            return None
        if self._bytes + chunk.total_size > self.max_pending_bytes:
            # not remembered as failed: the sender may retry once memory frees up
            raise CodecError(
                "reassembly-full",
                f"{self._bytes} bytes pending; {chunk.total_size} more exceeds {self.max_pending_bytes}",
            )
        mine = self._by_sender.get(sender, 0)
        if self.max_pending_per_sender is not None and mine + chunk.total_size > self.max_pending_per_sender:
            raise CodecError(
                "reassembly-full",
                f"{mine} bytes pending from {sender}; {chunk.total_size} more exceeds "
                f"{self.max_pending_per_sender} per sender",
            )
        p = _Pending(chunk.total, chunk.total_size, chunk.digest, cs, {}, now, sender)
        self._pending[chunk.msg_id] = p
        self._bytes += chunk.total_size
        self._by_sender[sender] = mine + chunk.total_size
        return p

    def _release(self, msg_id: str) -> _Pending | None:
        """Forget an incomplete message's reservation (completed, failed or expired)."""
        p = self._pending.pop(msg_id, None)
        if p is not None:
            self._bytes -= p.total_size
            left = self._by_sender[p.sender] - p.total_size
            if left:
                self._by_sender[p.sender] = left
            else:
                del self._by_sender[p.sender]
        return p

    def _finish(self, msg_id: str, body: bytes, want: bytes, now: float) -> bytes:
        if digest(body) != want:
            self._remember(msg_id, now, False)
            raise CodecError("bad-digest", f"reassembled message {msg_id} fails its digest")
        self._remember(msg_id, now, True)
        return body

    def _fail(self, msg_id: str, now: float) -> None:
        self._release(msg_id)
        self._remember(msg_id, now, False)

    def _remember(self, msg_id: str, now: float, ok: bool) -> None:
        self._finished[msg_id] = (now, ok)
        self._finished.move_to_end(msg_id)
        while len(self._finished) > self.max_finished:
            self._finished.popitem(last=False)

    def expire(self, now: float | None = None) -> list[str]:
        """Drop incomplete messages whose newest chunk is older than ``timeout_s``; their msg_ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return self._expire_locked(now)

    def _expire_locked(self, now: float) -> list[str]:
        cutoff = now - self.timeout_s
        expired = [(mid, p) for mid, p in self._pending.items() if p.last_seen < cutoff]
        for mid, p in expired:
            self._release(mid)
            # not remembered as failed: after a reconnect the broker redelivers every chunk of a confirmed
            # message (the held ones were unacked), and they must be able to complete it
            log.warning("chunked message expired", msg_id=mid, received=len(p.parts), total=p.total)
        while self._finished:
            mid, (when, _) = next(iter(self._finished.items()))
            if when >= cutoff:
                break
            self._finished.popitem(last=False)
        return [mid for mid, _ in expired]

    def pending_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def pending_ids(self) -> set[str]:
        with self._lock:
            return set(self._pending)

    def pending_messages(self) -> int:
        with self._lock:
            return len(self._pending)

    def is_duplicate(self, chunk: Chunk) -> bool:
        """True if this chunk was already received (pending message) or its message was already delivered."""
        with self._lock:
            done = self._finished.get(chunk.msg_id)
            if done is not None:
                return done[1]
            p = self._pending.get(chunk.msg_id)
            return p is not None and chunk.index in p.parts


@dataclass
class Tag:
    """The handle of a whole delivery: the backend's raw tags of every message it was made of."""

    raw: list[Any]
    gate: ChunkGate
    gen: int
    settled: bool = False


@dataclass
class Outcome:
    """What to do after feeding one raw delivery: hand ``deliver`` to the handler; ack/reject raw tags."""

    deliver: Delivery | None = None
    ack: list[Any] = field(default_factory=list)
    reject: list[Any] = field(default_factory=list)
    reason: str | None = None


class ChunkGate:
    """Per-consumer reassembly and prefetch-window bookkeeping (see module docstring). Thread-safe."""

    def __init__(
        self,
        window: int,
        *,
        max_message_size: int = 4 * 1024**3,
        max_pending_bytes: int = 4 * 1024**3,
        timeout_s: float = 600.0,
        max_pending_per_sender: int | None = None,
    ) -> None:
        self.window = max(1, window)
        self.reassembler = Reassembler(
            timeout_s=timeout_s,
            max_pending_bytes=max_pending_bytes,
            max_message_size=max_message_size,
            max_pending_per_sender=max_pending_per_sender,
        )
        self._lock = threading.Lock()
        self._held: dict[str, list[Any]] = {}  # msg_id -> raw tags of its chunks still unacked
        self._unsettled = 0  # raw deliveries received and not yet acked/rejected
        self.gen = 0
        self.rejected = 0
        self.early_acked = 0

    @classmethod
    def of(cls, window: int, limits: ReassemblyLimits, timeout_s: float) -> ChunkGate:
        return cls(
            window,
            max_message_size=limits.max_message_size,
            max_pending_bytes=limits.max_pending_bytes,
            timeout_s=timeout_s,
            max_pending_per_sender=limits.max_pending_per_sender,
        )

    def body_limit(self, properties: Any) -> int:
        """The most bytes one raw delivery may carry (``properties``: its AMQP properties): a whole message
        up to max_message_size, a chunk frame up to that plus its frame's overhead. A backend that sees the
        announced size first refuses a larger one from it (REFUSED_SIZE_HEADER); feed refuses it anyway."""
        headers = getattr(properties, "headers", None) or {}
        limit = self.reassembler.max_message_size
        return limit + FRAME_OVERHEAD if CHUNK_HEADER in headers else limit

    def expire(self) -> list[Any]:
        """Raw tags of the held chunks of messages that stayed incomplete past the timeout (their sender died
        mid-upload): the reassembler forgets them and the backend rejects these tags,
        so nothing stays unacked."""
        with self._lock:
            self.reassembler.expire()
            pending = self.reassembler.pending_ids()
            gone = [mid for mid in self._held if mid not in pending]  # expired, or rejected mid-way
            tags = [t for mid in gone for t in self._held.pop(mid)]
            self._unsettled -= len(tags)
            return tags

    def holding(self) -> bool:
        """Whether chunks of an incomplete message are held (an expiry check has work to do)."""
        with self._lock:
            return bool(self._held) or bool(self.reassembler.pending_ids())

    def reset(self) -> None:
        """The connection was lost: every raw tag is void (the broker requeued them);
        keep reassembled data."""
        with self._lock:
            self._held.clear()
            self._unsettled = 0
            self.gen += 1

    def settle(self, tag: Tag) -> list[Any]:
        """Mark a whole delivery as acked/rejected; its raw tags
        (empty if already settled or from an old connection)."""
        with self._lock:
            if tag.settled:
                return []
            tag.settled = True
            if tag.gen != self.gen:
                return []
            self._unsettled -= len(tag.raw)
            return list(tag.raw)

    def _refuse(self, d: Delivery, why: str, event: str, **fields: Any) -> Outcome:
        """Reject one raw delivery, logged as ``event`` with ``fields`` (the lock is held)."""
        self._unsettled -= 1
        self.rejected += 1
        log.warning(event, queue=d.queue, message_id=d.message_id, **fields)
        return Outcome(reject=[d.tag], reason=why)

    def feed(self, d: Delivery) -> Outcome:
        """Take one raw delivery (its ``tag`` is the backend's raw tag)."""
        raw = d.tag
        with self._lock:
            self._unsettled += 1
            announced = d.headers.get(REFUSED_SIZE_HEADER)
            size = announced if isinstance(announced, int) else len(d.body)
            if announced is not None or size > self.body_limit(d):
                return self._refuse(
                    d,
                    "too-large",
                    "message refused: larger than this consumer accepts",
                    routing_key=d.routing_key,
                    size=size,
                    limit=self.reassembler.max_message_size,
                    read=announced is None,
                )
            if CHUNK_HEADER not in d.headers:
                return Outcome(deliver=replace(d, tag=Tag([raw], self, self.gen)))
            try:
                chunk = decode_chunk(d.body)
                dup = self.reassembler.is_duplicate(chunk)
                body = None if dup else self.reassembler.add(chunk, sender=d.routing_key)
            except CodecError as exc:
                return self._refuse(d, exc.reason, "chunk rejected", reason=exc.reason, detail=str(exc))
            if dup:
                self._unsettled -= 1
                log.debug("duplicate chunk dropped", queue=d.queue, msg_id=chunk.msg_id, index=chunk.index)
                return Outcome(ack=[raw])
            tags = self._held.setdefault(chunk.msg_id, [])
            tags.append(raw)
            if body is not None:
                del self._held[chunk.msg_id]
                headers = {k: v for k, v in d.headers.items() if k != CHUNK_HEADER}
                whole = replace(
                    d, body=body, headers=headers, message_id=chunk.msg_id, tag=Tag(tags, self, self.gen)
                )
                return Outcome(deliver=whole)
            if self._unsettled >= self.window:
                early = [t for ts in self._held.values() for t in ts]
                for ts in self._held.values():
                    ts.clear()
                self._unsettled -= len(early)
                self.early_acked += len(early)
                log.info(
                    "prefetch window full of chunks: acking held chunks early",
                    queue=d.queue,
                    chunks=len(early),
                    window=self.window,
                )
                return Outcome(ack=early)
            return Outcome()


EXPIRY_CHECK_S = 1.0  # how often a dispatcher drops incomplete chunked messages past their timeout


class GatedDispatch:
    """ack/reject and the dispatcher's work, for one connection of any backend: each delivery goes through
    its consumer's ChunkGate. Built on the backend's ``consumers`` (tag -> an object with ``gate``,
    ``handler`` and optionally ``only``) and ``settle_raw(raw_tag, requeue)`` (requeue None = ack, False =
    reject and drop, True = requeue)."""

    def __init__(self, consumers: dict[str, Any], settle_raw: Callable[[Any, bool | None], None]) -> None:
        self._consumers = consumers
        self._settle_raw = settle_raw

    def settle(self, delivery: Delivery, requeue: bool | None) -> None:
        """Ack (``requeue`` None) or reject a whole delivery: every raw delivery it was made of."""
        tag = delivery.tag
        if not isinstance(tag, Tag) or not isinstance(tag.gate, ChunkGate):
            raise BrokerError("cannot ack/reject: the delivery did not come from this broker")
        for raw in tag.gate.settle(tag):
            self._settle_raw(raw, requeue)

    def dispatch(self, c: Any, raw: Delivery) -> None:
        """Feed one raw delivery to its consumer's gate; settle what the gate says; run the handler.

        A consumer reading for one message (``only``: a model reader on the stream) acks every other raw
        delivery unseen, before reassembly: skipping a model costs its bytes on the wire and nothing more."""
        only = getattr(c, "only", None)
        if only is not None and raw.message_id != only:
            self._settle_raw(raw.tag, None)
            return
        out = c.gate.feed(raw)
        for t in out.ack:
            self._settle_raw(t, None)
        for t in out.reject:
            self._settle_raw(t, False)
        if out.deliver is not None:
            self._run_handler(c.handler, out.deliver)

    def expire_due(self, last: float) -> float:
        """Every EXPIRY_CHECK_S: reject the held chunks of messages left incomplete past their timeout."""
        now = time.monotonic()
        if now - last < EXPIRY_CHECK_S:
            return last
        for c in list(self._consumers.values()):
            for t in c.gate.expire():
                self._settle_raw(t, False)
        return now

    def _run_handler(self, handler: Handler, d: Delivery) -> None:
        """Run a handler; if it raises, log and reject (no requeue) unless it already settled the delivery."""
        try:
            handler(d)
        except Exception as exc:  # a handler bug must not kill the dispatcher thread
            log.error(
                "message handler failed; message rejected",
                queue=d.queue,
                message_id=d.message_id,
                error=f"{type(exc).__name__}: {exc}",
            )
            tag = d.tag
            if isinstance(tag, Tag) and not tag.settled:
                try:
                    self.settle(d, False)
                except Exception as exc2:  # the connection may be gone; the broker requeues it then
                    log.warning("could not reject after handler failure", error=str(exc2))
