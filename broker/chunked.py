"""Transparent chunking for Broker backends: split on publish, reassemble per consumer.

A body over the chunk limit is published as several messages carrying the header ``x-fedmq-chunk`` whose
bodies are chunk frames (broker.chunking). Each consumer owns a :class:`ChunkGate` that turns the raw
deliveries of its queue into whole deliveries for the handler.

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
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from broker.base import Broker, Delivery, Handler, ReassemblyLimits
from broker.chunking import Chunk, Reassembler, decode_chunk, encode_chunk, encode_chunk_parts, split
from broker.errors import BrokerError
from fedmq.errors import CodecError

log = structlog.get_logger(__name__)

CHUNK_HEADER = "x-fedmq-chunk"


def chunk_messages(body: bytes, message_id: str, limit: int) -> list[bytes] | None:
    """Encoded chunk frames for ``body``, or None when it fits in one message."""
    parts = chunk_parts(body, message_id, limit)
    return None if parts is None else [encode_chunk(c) for c in parts]


def chunk_parts(body: bytes, message_id: str, limit: int) -> list[Chunk] | None:
    """The chunks of ``body`` (views of it, not encoded yet), or None when it fits in one message.

    A backend that hands each frame to the network right away encodes a chunk (``encode_chunk``) only when
    it sends it and drops the frame then: the frames of a 100 MB body are never all in memory, and the
    allocator reuses one frame's memory for the next instead of faulting in fresh pages for each.
    """
    if len(body) <= limit:
        return None
    return split(body, message_id, limit)


class ChunkFrame:
    """The encoded frame of a chunk seen as a read-only body: ``len`` and contiguous slices as bytes.

    Made of the frame's header and a view of the chunk's data, never joined: a transport that slices the
    body into its own frames (pika) copies each slice once, as it would slice a bytes body, so sending a
    chunk costs no copy beyond what sending an unchunked body costs. ``bytes(frame)`` is the joined frame.
    """

    __slots__ = ("head", "data", "_n")

    def __init__(self, chunk: Chunk) -> None:
        self.head, self.data = encode_chunk_parts(chunk)
        self._n = len(self.head) + self.data.nbytes

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, key: slice) -> bytes:
        if not isinstance(key, slice):
            raise TypeError("ChunkFrame supports slices only")
        start, stop, step = key.indices(self._n)
        if step != 1:
            raise ValueError("ChunkFrame supports contiguous slices only")
        h = len(self.head)
        if stop <= start:
            return b""
        if stop <= h:
            return self.head[start:stop]
        if start >= h:
            return self.data[start - h : stop - h].tobytes()
        return self.head[start:] + self.data[: stop - h].tobytes()

    def __bytes__(self) -> bytes:
        return b"".join((self.head, self.data))


@dataclass
class Tag:
    """The handle of a whole delivery: the backend's raw tags of every message it was made of."""

    raw: list[Any]
    gate: "ChunkGate"
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

    def __init__(self, window: int, *, max_message_size: int = 4 * 1024**3, max_pending_bytes: int = 4 * 1024**3,
                 timeout_s: float = 600.0, max_pending_per_sender: int | None = None) -> None:
        self.window = max(1, window)
        self.reassembler = Reassembler(timeout_s=timeout_s, max_pending_bytes=max_pending_bytes,
                                       max_message_size=max_message_size, max_pending_per_sender=max_pending_per_sender)
        self._lock = threading.Lock()
        self._held: dict[str, list[Any]] = {}  # msg_id -> raw tags of its chunks still unacked
        self._unsettled = 0  # raw deliveries received and not yet acked/rejected
        self.gen = 0
        self.rejected = 0
        self.early_acked = 0

    @classmethod
    def of(cls, window: int, limits: ReassemblyLimits, timeout_s: float) -> "ChunkGate":
        return cls(window, max_message_size=limits.max_message_size, max_pending_bytes=limits.max_pending_bytes,
                   timeout_s=timeout_s, max_pending_per_sender=limits.max_pending_per_sender)

    def expire(self) -> list[Any]:
        """Raw tags of the held chunks of messages that stayed incomplete past the timeout (their sender died
        mid-upload): the reassembler forgets them and the backend rejects these tags, so nothing stays unacked."""
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
        """The connection was lost: every raw tag is void (the broker requeued them); keep reassembled data."""
        with self._lock:
            self._held.clear()
            self._unsettled = 0
            self.gen += 1

    def settle(self, tag: Tag) -> list[Any]:
        """Mark a whole delivery as acked/rejected; its raw tags (empty if already settled or from an old connection)."""
        with self._lock:
            if tag.settled:
                return []
            tag.settled = True
            if tag.gen != self.gen:
                return []
            self._unsettled -= len(tag.raw)
            return list(tag.raw)

    def feed(self, d: Delivery) -> Outcome:
        """Take one raw delivery (its ``tag`` is the backend's raw tag)."""
        raw = d.tag
        with self._lock:
            self._unsettled += 1
            if CHUNK_HEADER not in d.headers:
                return Outcome(deliver=replace(d, tag=Tag([raw], self, self.gen)))
            try:
                chunk = decode_chunk(d.body)
                dup = self.reassembler.is_duplicate(chunk)
                body = None if dup else self.reassembler.add(chunk, sender=d.routing_key)
            except CodecError as exc:
                self._unsettled -= 1
                self.rejected += 1
                log.warning("chunk rejected", queue=d.queue, message_id=d.message_id, reason=exc.reason, detail=str(exc))
                return Outcome(reject=[raw], reason=exc.reason)
            if dup:
                self._unsettled -= 1
                log.debug("duplicate chunk dropped", queue=d.queue, msg_id=chunk.msg_id, index=chunk.index)
                return Outcome(ack=[raw])
            tags = self._held.setdefault(chunk.msg_id, [])
            tags.append(raw)
            if body is not None:
                del self._held[chunk.msg_id]
                headers = {k: v for k, v in d.headers.items() if k != CHUNK_HEADER}
                whole = replace(d, body=body, headers=headers, message_id=chunk.msg_id,
                                tag=Tag(tags, self, self.gen))
                return Outcome(deliver=whole)
            if self._unsettled >= self.window:
                early = [t for ts in self._held.values() for t in ts]
                for ts in self._held.values():
                    ts.clear()
                self._unsettled -= len(early)
                self.early_acked += len(early)
                log.info("prefetch window full of chunks: acking held chunks early", queue=d.queue,
                         chunks=len(early), window=self.window)
                return Outcome(ack=early)
            return Outcome()


EXPIRY_CHECK_S = 1.0  # how often a dispatcher drops incomplete chunked messages past their timeout


class GatedDispatch:
    """ack/reject and the dispatcher's work, shared by the backends: each delivery goes through its consumer's
    ChunkGate. A backend provides ``_consumers`` (objects with ``gate`` and ``handler``) and
    ``_settle_raw(raw_tag, requeue)`` (requeue None = ack, False = reject and drop, True = requeue)."""

    _consumers: dict[str, Any]

    def _settle_raw(self, raw: Any, requeue: bool | None) -> None:
        raise NotImplementedError

    def _settle(self, delivery: Delivery, requeue: bool | None) -> None:
        tag = delivery.tag
        if not isinstance(tag, Tag) or not isinstance(tag.gate, ChunkGate):
            raise BrokerError("cannot ack/reject: the delivery did not come from this broker")
        for raw in tag.gate.settle(tag):
            self._settle_raw(raw, requeue)

    def ack(self, delivery: Delivery) -> None:
        self._settle(delivery, None)

    def reject(self, delivery: Delivery, *, requeue: bool = False) -> None:
        self._settle(delivery, requeue)

    def _dispatch(self, c: Any, raw: Delivery) -> None:
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
            run_handler(self, c.handler, out.deliver)  # type: ignore[arg-type]

    def _expire_due(self, last: float) -> float:
        """Every EXPIRY_CHECK_S: reject the held chunks of messages left incomplete past their timeout."""
        now = time.monotonic()
        if now - last < EXPIRY_CHECK_S:
            return last
        for c in list(self._consumers.values()):
            for t in c.gate.expire():
                self._settle_raw(t, False)
        return now


def run_handler(broker: "Broker", handler: Handler, d: Delivery) -> None:
    """Run a handler; if it raises, log and reject (no requeue) unless it already settled the delivery."""
    try:
        handler(d)
    except Exception as exc:  # a handler bug must not kill the dispatcher thread
        log.error("message handler failed; message rejected", queue=d.queue, message_id=d.message_id,
                  error=f"{type(exc).__name__}: {exc}")
        tag = d.tag
        if isinstance(tag, Tag) and not tag.settled:
            try:
                broker.reject(d, requeue=False)
            except Exception as exc2:  # the connection may be gone; the broker requeues it then
                log.warning("could not reject after handler failure", error=str(exc2))
