"""The message envelope: schema version, kind, job, round, client, model version and a msgpack payload.

Wire layout::

    b"FMQ" | version (1 byte) | flags (1 byte) | xxh3-128 digest of body (16 bytes) | body

``body`` is the msgpack array ``[kind, job, round, client, model_version, msg_id, sent_at, payload]``,
zstd-compressed when flag bit 0 is set. ``pack`` compresses only bodies up to 1 MiB (control messages,
reports): large bodies are tensor payloads whose bytes encode_state already compressed per tensor, so a
second zstd pass would cost time and gain nothing. The version byte sits outside the body so an unknown
version is refused before anything is parsed; the digest is checked before anything is decompressed.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass, field
from enum import StrEnum

import msgpack
import zstandard as zstd

from fedmq.broker.wire.blobs import DIGEST_SIZE, digest, digest_of
from fedmq.broker.wire.untrusted import msgpack_options
from fedmq.errors import CodecError

SCHEMA_VERSION = 1
MAGIC = b"FMQ"
HEADER_SIZE = len(MAGIC) + 2 + DIGEST_SIZE
FLAG_ZSTD = 1
COMPRESS_MAX = 1 << 20  # bodies larger than this are not zstd'ed again (tensors already are)
_BIG = 1 << 16  # binary leaves this large are written by reference (see _segments)
_DEPTH = 8  # containers deeper than this are packed whole
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MAX_ID = 128
_INT_MAX = 1 << 62


class Kind(StrEnum):
    PRESENCE = "presence"
    ANNOUNCE = "announce"
    REPORT = "report"
    GRANT = "grant"
    UPDATE = "update"
    MODEL = "model"
    END = "end"
    EDGE_ROUND = "edge-round"
    PARTIAL = "partial"
    # secure aggregation (fedmq.secagg.payloads): client -> aggregator
    SECAGG_KEYS = "secagg-keys"
    SECAGG_SHARES = "secagg-shares"
    MASKED = "masked"
    SECAGG_ANSWER = "secagg-answer"
    # aggregator -> the round's clients
    SECAGG_COHORT = "secagg-cohort"
    SECAGG_INBOX = "secagg-inbox"
    SECAGG_UNMASK = "secagg-unmask"


_KINDS = tuple(k.value for k in Kind)


@dataclass(frozen=True)
class Envelope:
    kind: Kind
    job: str
    round: int
    client: str
    model_version: int
    payload: dict
    msg_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    sent_at: float = field(default_factory=time.time)
    version: int = SCHEMA_VERSION


@dataclass(frozen=True)
class Limits:
    """Bounds on one message. ``max_decompressed_bytes`` caps the zstd'ed body: ``pack`` compresses bodies of
    at most COMPRESS_MAX bytes only, so no valid message inflates further, and a frame declaring more (or no
    size) is refused before anything is decompressed. ``for_model`` bounds a whole message by a job's
    manifest."""

    max_message_bytes: int = 1 << 30
    max_decompressed_bytes: int = COMPRESS_MAX
    max_tensors: int = 10_000  # applied by decode_state callers; also caps msgpack array/map lengths below
    max_container_len: int = 1_000_000  # entries of any one msgpack array or map
    max_str_len: int = 1 << 20

    @classmethod
    def for_model(cls, message_bound: int) -> Limits:
        """Limits for messages of a job whose model message is at most ``message_bound`` bytes (its manifest's
        ``message_bound``): a message may carry the model at most twice (e.g. top-k values plus indices), plus
        1 MiB of framing; nothing decompresses past COMPRESS_MAX."""
        return cls(max_message_bytes=2 * int(message_bound) + COMPRESS_MAX)


def _check_fields(
    kind: object,
    job: object,
    rnd: object,
    client: object,
    mv: object,
    msg_id: object,
    sent_at: object,
    payload: object,
) -> Kind:
    if not isinstance(kind, str) or kind not in _KINDS:
        raise CodecError("unknown-kind", f"message kind {kind!r} is not one of {', '.join(_KINDS)}")
    k = Kind(kind)
    if not isinstance(job, str) or not _NAME.match(job):
        raise CodecError("bad-envelope", f"job {job!r} must be 1-64 letters, digits, '-' or '_'")
    if not isinstance(client, str) or (client and not _NAME.match(client)):
        raise CodecError(
            "bad-envelope", f"client {client!r} must be empty or 1-64 letters, digits, '-' or '_'"
        )
    for name, v in (("round", rnd), ("model_version", mv)):
        if type(v) is not int or not -1 <= v <= _INT_MAX:
            raise CodecError("bad-envelope", f"{name} must be an int >= -1, got {v!r}")
    if not isinstance(msg_id, str) or not 0 < len(msg_id) <= _MAX_ID:
        raise CodecError("bad-envelope", f"msg_id must be a non-empty str of at most {_MAX_ID} chars")
    if type(sent_at) not in (int, float) or not math.isfinite(sent_at):  # type: ignore[arg-type]
        raise CodecError("bad-envelope", f"sent_at must be a finite number, got {sent_at!r}")
    if not isinstance(payload, dict) or not all(isinstance(key, str) for key in payload):
        raise CodecError("bad-envelope", "payload must be a map with str keys")
    return k


def pack(env: Envelope, *, level: int = 3) -> bytes:
    """Serialize ``env``; CodecError if a field is invalid or the payload is not msgpack-able."""
    if env.version != SCHEMA_VERSION:
        raise CodecError(
            "unknown-version",
            f"cannot write schema version {env.version} (this build writes {SCHEMA_VERSION})",
        )
    kind = _check_fields(
        env.kind, env.job, env.round, env.client, env.model_version, env.msg_id, env.sent_at, env.payload
    )
    # The body is written as segments: msgpack-packed pieces plus the payload's large binary leaves by
    # reference (as bin32, exactly the bytes msgpack would write), digested piece by piece and copied once,
    # into the returned message. Tensor bytes are therefore copied once on the way out.
    fields = [
        kind.value,
        env.job,
        env.round,
        env.client,
        env.model_version,
        env.msg_id,
        float(env.sent_at),
        env.payload,
    ]
    packer = msgpack.Packer(use_bin_type=True)
    try:
        if not _has_big_bin(env.payload, 0):
            segs: list = [packer.pack(fields)]
        else:
            segs, pending = [], bytearray()
            _segments(fields, packer, segs, pending, 0)
            segs.append(pending)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError("bad-payload", f"payload is not msgpack-able: {exc}") from None
    size = sum(len(x) for x in segs)
    flags = 0
    if level and size <= COMPRESS_MAX:
        body = b"".join(segs)
        z = zstd.ZstdCompressor(level=level, write_content_size=True).compress(body)
        if len(z) < len(body):
            body, flags = z, FLAG_ZSTD
        segs = [body]
    return b"".join((MAGIC, bytes((SCHEMA_VERSION, flags)), digest_of(segs), *segs))


def _segments(obj: object, packer: msgpack.Packer, segs: list, pending: bytearray, depth: int) -> None:
    """Append the msgpack encoding of ``obj``: small pieces accumulate in ``pending``; a binary leaf of
    _BIG bytes or more ends the pending piece and goes into ``segs`` by reference. Containers deeper than
    _DEPTH are packed whole."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        view = memoryview(obj)
        if view.nbytes >= _BIG and view.c_contiguous and view.nbytes < 1 << 32:
            pending += b"\xc6" + view.nbytes.to_bytes(4, "big")
            segs.append(bytes(pending))
            pending.clear()
            segs.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
            return
    elif depth < _DEPTH and isinstance(obj, dict):
        pending += packer.pack_map_header(len(obj))
        for k, v in obj.items():
            pending += packer.pack(k)
            _segments(v, packer, segs, pending, depth + 1)
        return
    elif depth < _DEPTH and isinstance(obj, (list, tuple)):
        pending += packer.pack_array_header(len(obj))
        for v in obj:
            _segments(v, packer, segs, pending, depth + 1)
        return
    pending += packer.pack(obj)


def _has_big_bin(obj: object, depth: int) -> bool:
    """Does the payload hold a binary leaf of _BIG bytes or more (nesting deeper than _DEPTH not followed)?"""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return memoryview(obj).nbytes >= _BIG
    if depth < _DEPTH and isinstance(obj, dict):
        return any(_has_big_bin(v, depth + 1) for v in obj.values())
    if depth < _DEPTH and isinstance(obj, (list, tuple)):
        return any(_has_big_bin(v, depth + 1) for v in obj)
    return False


def unpack(data: bytes, *, limits: Limits = Limits()) -> Envelope:
    """Parse and verify a packed envelope; CodecError(reason) on anything wrong, never a partial result."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError("malformed", f"message must be bytes, got {type(data).__name__}")
    view = memoryview(data).cast("B")
    n = len(view)
    if n > limits.max_message_bytes:
        raise CodecError("too-large", f"message of {n} bytes exceeds {limits.max_message_bytes}")
    if n < HEADER_SIZE or view[:3] != MAGIC:
        raise CodecError("malformed", "not a fedmq message (bad magic or too short)")
    version, flags = view[3], view[4]
    if version != SCHEMA_VERSION:
        raise CodecError(
            "unknown-version",
            f"schema version {version} is not supported (this build reads {SCHEMA_VERSION})",
        )
    if flags & ~FLAG_ZSTD:
        raise CodecError("malformed", f"unknown flags {flags:#x}")
    body = view[HEADER_SIZE:]
    if digest(body) != view[5:HEADER_SIZE]:
        raise CodecError("bad-digest", "message body fails its digest")
    if flags & FLAG_ZSTD:
        try:
            size = zstd.get_frame_parameters(body).content_size
        except zstd.ZstdError:
            raise CodecError("bad-compression", "body is not a zstd frame") from None
        if size == zstd.CONTENTSIZE_UNKNOWN or size < 0 or size > limits.max_decompressed_bytes:
            raise CodecError(
                "bomb", f"compressed body declares {size} bytes (limit {limits.max_decompressed_bytes})"
            )
        try:
            body = memoryview(zstd.ZstdDecompressor().decompress(body, max_output_size=size))
        except zstd.ZstdError as exc:
            raise CodecError("bad-compression", f"zstd: {exc}") from None
    m = len(body)
    cap = min(m, limits.max_container_len)
    try:
        obj = msgpack.unpackb(
            body, **msgpack_options(bins=m, strs=min(m, limits.max_str_len), arrays=cap, maps=cap)
        )
    except Exception as exc:  # msgpack raises many unrelated types (ValueError, ExtraData, StackError, ...)
        raise CodecError("malformed", f"body is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(obj, list) or len(obj) != 8:
        raise CodecError("malformed", "body must be an 8-element array")
    kind, job, rnd, client, mv, msg_id, sent_at, payload = obj
    k = _check_fields(kind, job, rnd, client, mv, msg_id, sent_at, payload)
    return Envelope(k, job, rnd, client, mv, payload, msg_id=msg_id, sent_at=float(sent_at), version=version)
