"""Byte-level pieces of the wire codec: digests, byte-shuffle, bounded zstd blobs, bf16 bit conversion.

A *blob* is ``[codec, size, data]`` with codec 0 = stored, 1 = zstd; ``size`` is the decoded length. An
array travels as a list of blobs: one blob (unshuffled) or one per byte of its item size (byte-shuffled,
the way blosc does it: byte k of every element together). For trained float weights only the plane
holding sign + exponent compresses; mantissa planes are near-random, so a plane is zstd'ed only when a
sample of it shrinks by at least 5 %, else stored, which keeps encoding fast.
"""

from __future__ import annotations

import threading

import numpy as np
import xxhash
import zstandard as zstd

from broker.errors import CodecError

DIGEST_SIZE = 16
STORED, ZSTD = 0, 1
_SAMPLE = 128 * 1024
_MIN_GAIN = 0.95  # compress a plane only if its sample shrinks below this fraction
_BLOCK = 1 << 18  # elements per (un)shuffle block: keeps the working set in L2
_local = threading.local()


def digest(data: bytes | bytearray | memoryview) -> bytes:
    """xxh3-128 of ``data``: an integrity check against corruption (authenticity comes from AMQP user_id/TLS)."""
    return xxhash.xxh3_128_digest(data)


def _compressor(level: int) -> zstd.ZstdCompressor:
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstd.ZstdCompressor(level=level, write_content_size=True)
    return c


def _decompressor() -> zstd.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstd.ZstdDecompressor()
    return d


def make_blob(data: memoryview | bytes | np.ndarray, level: int, owned: bool = False) -> list:
    """A stored or zstd blob of ``data``, whichever the sample says is worth it.

    ``owned``: ``data`` is a private buffer, so a stored blob may reference it (msgpack packs memoryviews
    as bin) instead of copying; otherwise it is copied, so later changes to the caller's tensor cannot leak in.
    """
    buf = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    n = len(buf)

    def stored() -> list:
        return [STORED, n, buf if owned or isinstance(buf, bytes) else bytes(buf)]

    if level == 0 or n < 64:
        return stored()
    c = _compressor(level)
    if n > 2 * _SAMPLE:
        if len(c.compress(buf[:_SAMPLE])) > _MIN_GAIN * _SAMPLE:
            return stored()
    z = c.compress(buf)
    if len(z) > _MIN_GAIN * n:
        return stored()
    return [ZSTD, n, z]


def read_blob(blob: object, expected: int) -> bytes | memoryview:
    """The decoded bytes of a blob that must hold exactly ``expected`` bytes; never decompresses more."""
    if not isinstance(blob, list) or len(blob) != 3:
        raise CodecError("bad-tensor", "blob must be [codec, size, data]")
    codec, size, data = blob
    if type(size) is not int or size != expected:
        raise CodecError("bad-tensor", f"blob declares {size!r} bytes, the manifest implies {expected}")
    if not isinstance(data, (bytes, memoryview)):
        raise CodecError("bad-tensor", "blob data must be bytes")
    if isinstance(data, memoryview):  # straight from encode_state, not through msgpack
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    if codec == STORED:
        if len(data) != expected:
            raise CodecError("bad-tensor", f"stored blob has {len(data)} bytes, want {expected}")
        return data
    if codec != ZSTD or type(codec) is not int:
        raise CodecError("bad-tensor", f"unknown blob codec {codec!r}")
    try:
        params = zstd.get_frame_parameters(data)
    except zstd.ZstdError:
        raise CodecError("bad-compression", "blob is not a zstd frame") from None
    if params.content_size != expected:
        raise CodecError("bomb", f"zstd frame declares {params.content_size} bytes, want {expected}")
    try:
        out = _decompressor().decompress(data, max_output_size=expected)
    except zstd.ZstdError as exc:
        raise CodecError("bad-compression", f"zstd: {exc}") from None
    if len(out) != expected:
        raise CodecError("bad-compression", f"zstd produced {len(out)} bytes, want {expected}")
    return out


def pack_array(arr: np.ndarray, level: int, shuffle: bool, owned: bool = False) -> list:
    """Blobs of a contiguous 1-D array: byte-shuffled into ``itemsize`` planes when asked and useful.

    ``owned``: ``arr`` is a private temporary (not the caller's tensor) that stored blobs may reference.
    """
    w = arr.dtype.itemsize
    if not shuffle or w == 1 or level == 0 or arr.size < 1024:
        return [make_blob(memoryview(arr).cast("B"), level, owned)]
    n = arr.size
    u8 = arr.view(np.uint8).reshape(n, w)
    planes = np.empty((w, n), np.uint8)
    for i in range(0, n, _BLOCK):
        j = min(n, i + _BLOCK)
        for k in range(w):
            planes[k, i:j] = u8[i:j, k]
    return [make_blob(planes[k], level, True) for k in range(w)]


def unpack_array(blobs: object, dtype: np.dtype, n: int) -> np.ndarray:
    """The 1-D array of ``n`` items of ``dtype`` held by ``blobs`` (as written by pack_array)."""
    dtype = np.dtype(dtype)
    w = dtype.itemsize
    if not isinstance(blobs, list) or len(blobs) not in ({1, w}):
        raise CodecError("bad-tensor", f"expected 1 or {w} blobs for {dtype.name} data")
    if len(blobs) == 1:
        return np.frombuffer(read_blob(blobs[0], n * w), dtype=dtype)
    planes = [np.frombuffer(read_blob(b, n), dtype=np.uint8) for b in blobs]
    out = np.empty((n, w), np.uint8)
    for i in range(0, n, _BLOCK):
        j = min(n, i + _BLOCK)
        for k in range(w):
            out[i:j, k] = planes[k][i:j]
    return out.view(dtype).reshape(n)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 ``x``, rounded to nearest even; NaN stays a quiet NaN."""
    u = x.view(np.uint32)
    r = (u >> 16) & 1
    r += 0x7FFF
    r += u
    hi = (r >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        hi[nan] = ((u[nan] >> 16) & 0x8000).astype(np.uint16) | 0x7FC0
    return hi


def bf16_to_f32(h: np.ndarray) -> np.ndarray:
    out = h.astype(np.uint32)
    out <<= 16
    return out.view(np.float32)
