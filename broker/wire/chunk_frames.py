"""The chunk frame format: a large message body split into chunk frames, each frame encoded and decoded.

Putting the frames of a message back together on the consuming side is broker.transport.reassembly.

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
frame (a copy only when the frame is not ``bytes``); the reassembler (broker.transport.reassembly) keeps the
views until the last chunk arrives and joins them into the body. Each side hashes every byte twice with xxh3
(chunk digest, then whole-message digest), which costs a fraction of one copy.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import msgpack
import xxhash

from fedmq.broker.wire.blobs import DIGEST_SIZE, digest
from fedmq.broker.wire.untrusted import msgpack_options
from fedmq.errors import CodecError

DEFAULT_CHUNK_LIMIT = 8 * 1024 * 1024
MAGIC = "fedmq-chunk"
FRAME_VERSION = 1
MAX_MSG_ID_LEN = 128
MAX_TOTAL = 1 << 20  # chunks per message
FRAME_OVERHEAD = 256  # upper bound on frame bytes beyond the chunk data
_CHUNK_SEED = 0x666564_6D71  # "fedmq": per-chunk digests differ from whole-message ones
_MAGIC_PREFIX = msgpack.packb([MAGIC])[1:]  # the packed magic string, right after the array header
# a valid frame's fields before the data fit in this many bytes (msg_id <= 512 UTF-8 bytes)
_HEADER_MAX = 1024


@dataclass(frozen=True)
class Chunk:
    msg_id: str
    index: int
    total: int
    total_size: int
    digest: bytes  # xxh3-128 of the whole message body
    data: bytes | memoryview  # a view of the body (split) or of the frame (decode_chunk); 1-D, bytes


def _chunk_digest(
    msg_id: str, index: int, total: int, total_size: int, whole: bytes, data: bytes | memoryview
) -> bytes:
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
    size = byte_view(body).nbytes
    total = max(1, math.ceil(size / limit))
    if total > MAX_TOTAL:
        raise CodecError(
            "too-many-chunks", f"{size} bytes at {limit} bytes per chunk needs {total} > {MAX_TOTAL} chunks"
        )
    whole = digest(body)
    view = byte_view(body)
    return [Chunk(msg_id, i, total, size, whole, view[i * limit : (i + 1) * limit]) for i in range(total)]


def encode_chunk(chunk: Chunk) -> bytes:
    """The self-describing msgpack frame of one chunk, with a per-chunk digest."""
    head, data = encode_chunk_parts(chunk)
    # the same bytes as packb of the 9-element array, with one copy of the data instead of three
    return b"".join((head, data))


def encode_chunk_parts(chunk: Chunk) -> tuple[bytes, memoryview]:
    """The frame of :func:`encode_chunk` as (everything before the data, a view of the data): no copy.

    For a transport that copies the body into its own frames anyway (pika cuts it into 128 KiB AMQP body
    frames), see :class:`ChunkFrame`.
    """
    _check_fields(chunk.msg_id, chunk.index, chunk.total, chunk.total_size, chunk.digest, chunk.data)
    data = byte_view(chunk.data)
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


def byte_view(data: object) -> memoryview:
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
    return (
        len(data) > 1 + len(_MAGIC_PREFIX)
        and data[0] == 0x99
        and data[1 : 1 + len(_MAGIC_PREFIX)] == _MAGIC_PREFIX
    )


def decode_chunk(data: bytes) -> Chunk:
    """Parse and verify one chunk frame; CodecError(reason) on anything malformed or a bad chunk digest.

    The frame must be exactly one msgpack 9-element array (no trailing bytes). The fields before the data
    are unpacked with msgpack's bounded Unpacker from at most ``_HEADER_MAX`` leading bytes; the data's bin
    header is read by hand and the data returned as a view of ``data`` when it is ``bytes`` (immutable).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError("bad-chunk", f"chunk frame must be bytes, got {type(data).__name__}")
    view = byte_view(data)
    try:
        up = msgpack.Unpacker(
            max_buffer_size=_HEADER_MAX,
            **msgpack_options(bins=_HEADER_MAX, strs=_HEADER_MAX, arrays=9, maps=0),
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
        raise CodecError(
            "unknown-version", f"chunk frame version {version!r} is not supported (want {FRAME_VERSION})"
        )
    payload = _bin_at(data, view, pos)
    _check_fields(msg_id, index, total, total_size, whole, payload)
    if not isinstance(cd, bytes) or len(cd) != DIGEST_SIZE:
        raise CodecError("bad-chunk", "chunk digest must be 16 bytes")
    if _chunk_digest(msg_id, index, total, total_size, whole, payload) != cd:
        raise CodecError("bad-digest", f"chunk {index}/{total} of message {msg_id} fails its digest")
    return Chunk(msg_id, index, total, total_size, whole, payload)


def _bin_at(data: object, view: memoryview, pos: int) -> bytes | memoryview:
    """The msgpack bin at ``pos`` that must end the frame exactly: a view if ``data`` is bytes,
    else a copy."""
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
        raise CodecError(
            "bad-chunk", f"malformed chunk frame ({'truncated' if start + size > n else 'trailing bytes'})"
        )
    payload = view[start:n]
    return payload.toreadonly() if isinstance(data, bytes) else payload.tobytes()


def _check_msg_id(msg_id: object) -> None:
    if not isinstance(msg_id, str) or not 0 < len(msg_id) <= MAX_MSG_ID_LEN:
        raise CodecError("bad-chunk", f"msg_id must be a non-empty str of at most {MAX_MSG_ID_LEN} chars")


def _check_fields(
    msg_id: object, index: object, total: object, total_size: object, whole: object, payload: object
) -> None:
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
    size = byte_view(payload).nbytes
    if size > total_size:  # type: ignore[operator]
        raise CodecError("bad-chunk", f"chunk carries {size} bytes of a {total_size}-byte message")


def chunk_size(chunk: Chunk) -> int:
    """The uniform chunk size implied by one chunk (all but the last chunk carry exactly this many bytes)."""
    n, total, size = byte_view(chunk.data).nbytes, chunk.total, chunk.total_size
    if total == 1:
        if n != size:
            raise CodecError("bad-chunk", f"single chunk carries {n} of {size} bytes")
        return max(n, 1)
    if chunk.index < total - 1:
        cs = n
    else:
        rest = size - n
        if rest <= 0 or rest % (total - 1):
            raise CodecError(
                "bad-chunk", f"last chunk size {n} does not fit {total} chunks of a {size}-byte message"
            )
        cs = rest // (total - 1)
    if cs < 1 or not (cs * (total - 1) < size <= cs * total):
        raise CodecError("bad-chunk", f"chunk size {cs} does not fit {total} chunks of a {size}-byte message")
    return cs


CHUNK_HEADER = "x-fedmq-chunk"  # the AMQP header that marks a message body as a chunk frame


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
