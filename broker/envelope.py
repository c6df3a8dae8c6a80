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
from enum import Enum

import msgpack
import zstandard as zstd

from broker._codec_bytes import DIGEST_SIZE, digest
from broker.errors import CodecError

SCHEMA_VERSION = 1
MAGIC = b"FMQ"
HEADER_SIZE = len(MAGIC) + 2 + DIGEST_SIZE
FLAG_ZSTD = 1
COMPRESS_MAX = 1 << 20  # bodies larger than this are not zstd'ed again (tensors already are)
_BUF_SLACK = 1 << 16  # packing buffer beyond the payload's binary bytes (field names, numbers, headers)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MAX_ID = 128
_INT_MAX = 1 << 62


class Kind(str, Enum):
    PRESENCE = "presence"
    ANNOUNCE = "announce"
    REPORT = "report"
    GRANT = "grant"
    UPDATE = "update"


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
    max_message_bytes: int = 1 << 30
    max_decompressed_bytes: int = 2 << 30
    max_tensors: int = 10_000  # applied by decode_state callers; also caps msgpack array/map lengths below
    max_container_len: int = 1_000_000  # entries of any one msgpack array or map
    max_str_len: int = 1 << 20


def _check_fields(kind: object, job: object, rnd: object, client: object, mv: object, msg_id: object, sent_at: object, payload: object) -> Kind:
    try:
        k = Kind(kind)
    except ValueError:
        raise CodecError("unknown-kind", f"message kind {kind!r} is not one of {', '.join(k.value for k in Kind)}") from None
    if not isinstance(job, str) or not _NAME.match(job):
        raise CodecError("bad-envelope", f"job {job!r} must be 1-64 letters, digits, '-' or '_'")
    if not isinstance(client, str) or (client and not _NAME.match(client)):
        raise CodecError("bad-envelope", f"client {client!r} must be empty or 1-64 letters, digits, '-' or '_'")
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
        raise CodecError("unknown-version", f"cannot write schema version {env.version} (this build writes {SCHEMA_VERSION})")
    kind = _check_fields(env.kind, env.job, env.round, env.client, env.model_version, env.msg_id, env.sent_at, env.payload)
    # One Packer buffer sized for the payload's binary data up front (no regrowth copies); the body is
    # digested in place and copied once, into the returned message.
    packer = msgpack.Packer(use_bin_type=True, autoreset=False, buf_size=_BUF_SLACK + _bin_bytes(env.payload, 0))
    try:
        packer.pack(
            [kind.value, env.job, env.round, env.client, env.model_version, env.msg_id, float(env.sent_at), env.payload]
        )
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError("bad-payload", f"payload is not msgpack-able: {exc}") from None
    body: bytes | memoryview = packer.getbuffer()
    flags = 0
    if level and len(body) <= COMPRESS_MAX:
        z = zstd.ZstdCompressor(level=level, write_content_size=True).compress(body)
        if len(z) < len(body):
            body, flags = z, FLAG_ZSTD
    return b"".join((MAGIC, bytes((SCHEMA_VERSION, flags)), digest(body), body))


def _bin_bytes(obj: object, depth: int) -> int:
    """Bytes of the binary leaves of a payload (a packing-buffer size hint; deep nesting is not followed)."""
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, memoryview):
        return obj.nbytes
    if depth < 8 and isinstance(obj, dict):
        return sum(_bin_bytes(v, depth + 1) for v in obj.values())
    if depth < 8 and isinstance(obj, (list, tuple)):
        return sum(_bin_bytes(v, depth + 1) for v in obj)
    return 0


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
        raise CodecError("unknown-version", f"schema version {version} is not supported (this build reads {SCHEMA_VERSION})")
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
            raise CodecError("bomb", f"compressed body declares {size} bytes (limit {limits.max_decompressed_bytes})")
        try:
            body = memoryview(zstd.ZstdDecompressor().decompress(body, max_output_size=size))
        except zstd.ZstdError as exc:
            raise CodecError("bad-compression", f"zstd: {exc}") from None
    m = len(body)
    cap = min(m, limits.max_container_len)
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_bin_len=m,
            max_str_len=min(m, limits.max_str_len),
            max_array_len=cap,
            max_map_len=cap,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many unrelated types (ValueError, ExtraData, StackError, ...)
        raise CodecError("malformed", f"body is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(obj, list) or len(obj) != 8:
        raise CodecError("malformed", "body must be an 8-element array")
    kind, job, rnd, client, mv, msg_id, sent_at, payload = obj
    k = _check_fields(kind, job, rnd, client, mv, msg_id, sent_at, payload)
    return Envelope(k, job, rnd, client, mv, payload, msg_id=msg_id, sent_at=float(sent_at), version=version)
