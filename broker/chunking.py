"""Splitting large message bodies into chunk frames and reassembling them.

RabbitMQ refuses very large messages, so a body over ``limit`` bytes travels as ``total`` chunk frames.
Every frame is a small msgpack array::

    ["fedmq-chunk", 1, msg_id, index, total, total_size, whole_digest, chunk_digest, data]

``whole_digest`` is xxh3-128 of the whole body (checked after reassembly); ``chunk_digest`` is xxh3-128
(seeded differently) over the frame header fields and ``data`` (checked by :func:`decode_chunk`). xxh3 (the
``xxhash`` package) runs at >5 GB/s against ~0.8 GB/s for blake2b here; the digests guard against corruption,
not forgery (identity comes from the AMQP user_id and TLS).

``limit`` bounds the *data* of a chunk; the encoded frame adds at most :data:`FRAME_OVERHEAD` bytes
(for an ASCII msg_id). All chunks of a message but the last carry exactly ``limit`` bytes, so the receiver
knows each chunk's offset on arrival (out of order is fine) once the limits are checked.

Copies (they dominate the cost of chunking, see docs/benchmarks.md "## Broker"): each side copies the
data once. :func:`split` returns zero-copy memoryview slices of the body; :func:`encode_chunk` writes the
frame header and the data in one ``join`` (byte-identical to ``msgpack.packb`` of the 9-element array), and
:func:`encode_chunk_parts` returns the header and a view of the data for a transport that copies them out
itself (the RabbitMQ backend: no copy of ours on publish);
:func:`decode_chunk` parses the small header with msgpack and returns the data as a read-only view of the
frame (a copy only when the frame is not ``bytes``); :class:`Reassembler` keeps the views until the last
chunk arrives and joins them into the body. Each side hashes every byte twice with xxh3 (chunk digest,
then whole-message digest), which costs a fraction of one copy.
"""

from __future__ import annotations

import math
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import msgpack
import structlog
import xxhash

from broker._codec_bytes import DIGEST_SIZE, digest
from fedmq.errors import CodecError

log = structlog.get_logger(__name__)

DEFAULT_CHUNK_LIMIT = 8 * 1024 * 1024
MAGIC = "fedmq-chunk"
FRAME_VERSION = 1
MAX_MSG_ID_LEN = 128
MAX_TOTAL = 1 << 20  # chunks per message
FRAME_OVERHEAD = 256  # upper bound on frame bytes beyond the chunk data
_CHUNK_SEED = 0x666564_6D71  # "fedmq": per-chunk digests differ from whole-message ones
_MAGIC_PREFIX = msgpack.packb([MAGIC])[1:]  # the packed magic string, right after the array header
_HEADER_MAX = 1024  # a valid frame's fields before the data fit in this many bytes (msg_id <= 512 UTF-8 bytes)


@dataclass(frozen=True)
class Chunk:
    msg_id: str
    index: int
    total: int
    total_size: int
    digest: bytes  # xxh3-128 of the whole message body
    data: bytes | memoryview  # a view of the body (split) or of the frame (decode_chunk); 1-D, bytes


def _chunk_digest(msg_id: str, index: int, total: int, total_size: int, whole: bytes, data: bytes | memoryview) -> bytes:
    h = xxhash.xxh3_128(seed=_CHUNK_SEED)
    h.update(msgpack.packb([msg_id, index, total, total_size, whole]))
    h.update(data)
    return h.digest()


def split(body: bytes, msg_id: str, limit: int = DEFAULT_CHUNK_LIMIT) -> list[Chunk]:
    """Split ``body`` into chunks of ``limit`` bytes (the last may be shorter); one chunk if it fits.

    The chunks' data are views of ``body`` (no copy): do not modify a mutable ``body`` while they are in use.
    """
    if not isinstance(limit, int) or limit < 1:
        raise CodecError("bad-chunk-limit", f"chunk limit must be a positive int, got {limit!r}")
    _check_msg_id(msg_id)
    size = _byte_view(body).nbytes
    total = max(1, math.ceil(size / limit))
    if total > MAX_TOTAL:
        raise CodecError("too-many-chunks", f"{size} bytes at {limit} bytes per chunk needs {total} > {MAX_TOTAL} chunks")
    whole = digest(body)
    view = _byte_view(body)
    return [Chunk(msg_id, i, total, size, whole, view[i * limit : (i + 1) * limit]) for i in range(total)]


def encode_chunk(chunk: Chunk) -> bytes:
    """The self-describing msgpack frame of one chunk, with a per-chunk digest."""
    head, data = encode_chunk_parts(chunk)
    # the same bytes as packb of the 9-element array, with one copy of the data instead of three
    return b"".join((head, data))


def encode_chunk_parts(chunk: Chunk) -> tuple[bytes, memoryview]:
    """The frame of :func:`encode_chunk` as (everything before the data, a view of the data): no copy.

    For a transport that copies the body into its own frames anyway (pika cuts it into 128 KiB AMQP body
    frames), see ``broker.chunked.ChunkFrame``.
    """
    _check_fields(chunk.msg_id, chunk.index, chunk.total, chunk.total_size, chunk.digest, chunk.data)
    data = _byte_view(chunk.data)
    cd = _chunk_digest(chunk.msg_id, chunk.index, chunk.total, chunk.total_size, chunk.digest, data)
    head = msgpack.packb(
        [MAGIC, FRAME_VERSION, chunk.msg_id, chunk.index, chunk.total, chunk.total_size, chunk.digest, cd],
        use_bin_type=True,
    )
    return b"\x99" + head[1:] + _bin_header(data.nbytes), data


def _bin_header(n: int) -> bytes:
    """msgpack's header of an ``n``-byte bin (the smallest form, as packb writes it)."""
    if n < 1 << 8:
        return struct.pack(">BB", 0xC4, n)
    if n < 1 << 16:
        return struct.pack(">BH", 0xC5, n)
    if n < 1 << 32:
        return struct.pack(">BI", 0xC6, n)
    raise CodecError("bad-chunk", f"chunk data of {n} bytes exceeds msgpack's bin limit")


def _byte_view(data: object) -> memoryview:
    """A flat byte view of a bytes-like ``data``; CodecError for anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError("bad-chunk", f"chunk data must be bytes, got {type(data).__name__}")
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        if not view.c_contiguous:
            raise CodecError("bad-chunk", "chunk data must be a contiguous buffer")
        view = view.cast("B")
    return view


def is_chunk_frame(data: bytes) -> bool:
    """Cheap sniff: does ``data`` start like a chunk frame? (No validation; use decode_chunk for that.)"""
    return len(data) > 1 + len(_MAGIC_PREFIX) and data[0] == 0x99 and data[1 : 1 + len(_MAGIC_PREFIX)] == _MAGIC_PREFIX


def decode_chunk(data: bytes) -> Chunk:
    """Parse and verify one chunk frame; CodecError(reason) on anything malformed or a bad chunk digest.

    The frame must be exactly one msgpack 9-element array (no trailing bytes). The fields before the data
    are unpacked with msgpack's bounded Unpacker from at most ``_HEADER_MAX`` leading bytes; the data's bin
    header is read by hand and the data returned as a view of ``data`` when it is ``bytes`` (immutable).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError("bad-chunk", f"chunk frame must be bytes, got {type(data).__name__}")
    view = _byte_view(data)
    try:
        up = msgpack.Unpacker(
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_buffer_size=_HEADER_MAX,
            max_bin_len=_HEADER_MAX,
            max_str_len=_HEADER_MAX,
            max_array_len=9,
            max_map_len=0,
            max_ext_len=0,
        )
        up.feed(view[:_HEADER_MAX])
        count = up.read_array_header()
        if count != 9:
            raise CodecError("bad-chunk", "chunk frame is not a 9-element array")
        fields = [up.unpack() for _ in range(8)]
        pos = up.tell()
    except CodecError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on malformed or truncated input
        raise CodecError("bad-chunk", f"malformed chunk frame ({type(exc).__name__})") from None
    magic, version, msg_id, index, total, total_size, whole, cd = fields
    if magic != MAGIC:
        raise CodecError("bad-chunk", "not a fedmq chunk frame")
    if type(version) is not int or version != FRAME_VERSION:
        raise CodecError("unknown-version", f"chunk frame version {version!r} is not supported (want {FRAME_VERSION})")
    payload = _bin_at(data, view, pos)
    _check_fields(msg_id, index, total, total_size, whole, payload)
    if not isinstance(cd, bytes) or len(cd) != DIGEST_SIZE:
        raise CodecError("bad-chunk", "chunk digest must be 16 bytes")
    if _chunk_digest(msg_id, index, total, total_size, whole, payload) != cd:
        raise CodecError("bad-digest", f"chunk {index}/{total} of message {msg_id} fails its digest")
    return Chunk(msg_id, index, total, total_size, whole, payload)


def _bin_at(data: object, view: memoryview, pos: int) -> bytes | memoryview:
    """The msgpack bin at ``pos`` that must end the frame exactly: a view if ``data`` is bytes, else a copy."""
    n = view.nbytes
    if pos >= n:
        raise CodecError("bad-chunk", "malformed chunk frame (truncated before the data)")
    kind = view[pos]
    width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(kind)
    if width is None:
        raise CodecError("bad-chunk", "chunk data must be bytes")
    start = pos + 1 + width
    if start > n:
        raise CodecError("bad-chunk", "malformed chunk frame (truncated data header)")
    size = int.from_bytes(view[pos + 1 : start], "big")
    if start + size != n:
        raise CodecError("bad-chunk", f"malformed chunk frame ({'truncated' if start + size > n else 'trailing bytes'})")
    payload = view[start:n]
    return payload.toreadonly() if isinstance(data, bytes) else payload.tobytes()


def _check_msg_id(msg_id: object) -> None:
    if not isinstance(msg_id, str) or not 0 < len(msg_id) <= MAX_MSG_ID_LEN:
        raise CodecError("bad-chunk", f"msg_id must be a non-empty str of at most {MAX_MSG_ID_LEN} chars")


def _check_fields(msg_id: object, index: object, total: object, total_size: object, whole: object, payload: object) -> None:
    _check_msg_id(msg_id)
    for name, v in (("index", index), ("total", total), ("total_size", total_size)):
        if type(v) is not int:
            raise CodecError("bad-chunk", f"chunk {name} must be an int, got {type(v).__name__}")
    if not 1 <= total <= MAX_TOTAL:  # type: ignore[operator]
        raise CodecError("bad-chunk", f"chunk total {total} outside 1..{MAX_TOTAL}")
    if not 0 <= index < total:  # type: ignore[operator]
        raise CodecError("bad-chunk", f"chunk index {index} outside 0..{total - 1}")  # type: ignore[operator]
    if total_size < 0:  # type: ignore[operator]
        raise CodecError("bad-chunk", f"negative total_size {total_size}")
    if not isinstance(whole, bytes) or len(whole) != DIGEST_SIZE:
        raise CodecError("bad-chunk", "message digest must be 16 bytes")
    size = _byte_view(payload).nbytes
    if size > total_size:  # type: ignore[operator]
        raise CodecError("bad-chunk", f"chunk carries {size} bytes of a {total_size}-byte message")


def _chunk_size(chunk: Chunk) -> int:
    """The uniform chunk size implied by one chunk (all but the last chunk carry exactly this many bytes)."""
    n, total, size = _byte_view(chunk.data).nbytes, chunk.total, chunk.total_size
    if total == 1:
        if n != size:
            raise CodecError("bad-chunk", f"single chunk carries {n} of {size} bytes")
        return max(n, 1)
    if chunk.index < total - 1:
        cs = n
    else:
        rest = size - n
        if rest <= 0 or rest % (total - 1):
            raise CodecError("bad-chunk", f"last chunk size {n} does not fit {total} chunks of a {size}-byte message")
        cs = rest // (total - 1)
    if cs < 1 or not (cs * (total - 1) < size <= cs * total):
        raise CodecError("bad-chunk", f"chunk size {cs} does not fit {total} chunks of a {size}-byte message")
    return cs


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
    joined into the body, the one copy on this side, when the last one arrives. An incomplete message is dropped ``timeout_s`` after its most
    recent chunk (checked on every ``add`` and by ``expire``). Ids of finished messages (completed or
    rejected) are remembered for ``timeout_s`` so late duplicates do not start a new partial message.
    ``max_pending_per_sender`` (optional) bounds the reserved bytes of one ``sender`` (the aggregator passes
    each delivery's routing key, which names the agent), so one sender cannot take the whole budget.
    Thread-safe.
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
                    return self._finish(chunk.msg_id, _byte_view(chunk.data).tobytes()
                                        if not isinstance(chunk.data, bytes) else chunk.data, chunk.digest, now)
            else:
                if (chunk.total, chunk.total_size, chunk.digest) != (p.total, p.total_size, p.digest):
                    self._fail(chunk.msg_id, now)
                    raise CodecError("inconsistent-chunk", f"chunk {chunk.index} of {chunk.msg_id} disagrees with earlier chunks")
                if chunk.index in p.parts:
                    p.last_seen = now
                    return None
            expected = min(p.chunk_size, p.total_size - chunk.index * p.chunk_size)
            data = chunk.data if isinstance(chunk.data, bytes) else _byte_view(chunk.data)
            if len(data) != expected:
                self._fail(chunk.msg_id, now)
                raise CodecError("inconsistent-chunk", f"chunk {chunk.index} of {chunk.msg_id} has {len(data)} bytes, want {expected}")
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
            raise CodecError("too-large", f"message {chunk.msg_id} of {chunk.total_size} bytes exceeds {self.max_message_size}")
        try:
            cs = _chunk_size(chunk)
        except CodecError:
            self._remember(chunk.msg_id, now, False)
            raise
        if chunk.total == 1:
            return None
        if self._bytes + chunk.total_size > self.max_pending_bytes:
            # not remembered as failed: the sender may retry once memory frees up
            raise CodecError("reassembly-full", f"{self._bytes} bytes pending; {chunk.total_size} more exceeds {self.max_pending_bytes}")
        mine = self._by_sender.get(sender, 0)
        if self.max_pending_per_sender is not None and mine + chunk.total_size > self.max_pending_per_sender:
            raise CodecError("reassembly-full", f"{mine} bytes pending from {sender}; {chunk.total_size} more exceeds "
                                                f"{self.max_pending_per_sender} per sender")
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
        dropped = [mid for mid, p in self._pending.items() if p.last_seen < cutoff]
        for mid in dropped:
            p = self._release(mid)
            # not remembered as failed: after a reconnect the broker redelivers every chunk of a confirmed message
            # (the held ones were unacked), and they must be able to complete it
            log.warning("chunked message expired", msg_id=mid, received=len(p.parts), total=p.total)
        while self._finished:
            mid, (when, _) = next(iter(self._finished.items()))
            if when >= cutoff:
                break
            self._finished.popitem(last=False)
        return dropped

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
