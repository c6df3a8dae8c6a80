"""Byte-level pieces of the wire codec: digests, byte-shuffle, bounded zstd blobs, bf16 bit conversion.

A *blob* is ``[codec, size, data]`` with codec 0 = stored, 1 = zstd; ``size`` is the decoded length. An
array of n items of w bytes travels as a list of 1 to w blobs, each a *byte group* of width g = size / n
(the widths sum to w), low bytes first: blob k holds bytes [off, off + g) of every element, in element
order. One blob of width w is the array as is; w blobs of width 1 are the blosc-style byte-shuffle (byte k
of every element together). For trained float weights only the plane holding sign + exponent compresses
(plus, for XOR deltas, the next one); the two low mantissa bytes are near-random, so for 4-byte items whose
byte 1 does not compress (a sample says) they travel as one stored 2-byte group: one strided copy instead
of two. A plane is zstd'ed only when a sample of it shrinks by at least 5 %, else stored.

Speed (see docs/benchmarks.md "## Codec"): the work is split into tasks run on the codec threads
(broker.wire.threads): on encode one task per byte group (gather it from every element, XOR it with
the base's for a raw delta, then compress or store it); on decode one task per compressed blob, then one
per block of elements (interleave the groups back into a preallocated array, plus the caller's per-block step,
e.g. the XOR of a raw delta and the NaN/Inf check, while the block is in cache). At level 1 (the default)
blobs are compressed with ``PLANE_PARAMS``, a zstd level-1 variant for byte planes: fast strategy, 64-entry
hash table, matches of 7+ bytes, 128 KiB window. Sign/exponent planes have few long repeats, so zstd's time
goes to match search that finds nothing; these parameters leave it to the Huffman literal coder, measured ~3x
faster than stock level 1 and smaller (2.77x vs 2.62x on a 10M-entry weight matrix).
Frames are ordinary zstd frames.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from functools import partial

import numpy as np
import numpy.typing as npt
import xxhash
import zstandard as zstd

from fedmq.broker.wire.threads import Task, run_all
from fedmq.errors import CodecError

DIGEST_SIZE = 16
STORED, ZSTD = 0, 1
_SAMPLE = 128 * 1024
_MIN_GAIN = 0.95  # compress a plane only if its sample shrinks below this fraction
_BLOCK = 1 << 18  # elements per un-shuffle task: keeps the working set in L2
PLANE_PARAMS = dict(
    window_log=17,
    hash_log=6,
    chain_log=6,
    search_log=1,
    min_match=7,
    target_length=0,
    strategy=zstd.STRATEGY_FAST,
)
_local = threading.local()
_LITTLE = sys.byteorder == "little"  # the low byte group is the low-order end of an item


def digest(data: bytes | bytearray | memoryview) -> bytes:
    """xxh3-128 of ``data``: an integrity check against corruption
    (authenticity comes from AMQP user_id/TLS)."""
    return xxhash.xxh3_128_digest(data)


def digest_of(parts: list) -> bytes:
    """``digest`` of the concatenation of ``parts``, without concatenating them."""
    h = xxhash.xxh3_128()
    for x in parts:
        h.update(x)
    return h.digest()


def _compressor(level: int) -> zstd.ZstdCompressor:
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    c = cache.get(level)
    if c is None:
        if level == 1:
            params = zstd.ZstdCompressionParameters(write_content_size=True, **PLANE_PARAMS)
            c = zstd.ZstdCompressor(compression_params=params)
        else:
            c = zstd.ZstdCompressor(level=level, write_content_size=True)
        cache[level] = c
    return c


def _decompressor() -> zstd.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstd.ZstdDecompressor()
    return d


def make_blob(data: memoryview | bytes | np.ndarray, level: int, owned: bool = False) -> list:
    """A stored or zstd blob of ``data``, whichever the sample says is worth it.

    ``owned``: ``data`` is a private buffer, so a stored blob may reference it (msgpack packs memoryviews
    as bin) instead of copying; otherwise it is copied,
    so later changes to the caller's tensor cannot leak in.
    """
    # ndarray.data: the array's memoryview (numpy's stubs make ndarray a Buffer only from Python 3.12)
    buf = data if isinstance(data, bytes) else (data.data if isinstance(data, np.ndarray) else data).cast("B")
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


def check_blob(blob: object, expected: int) -> tuple[int, bytes | memoryview]:
    """(codec, data) of a blob that must decode to exactly ``expected`` bytes; checks a zstd frame's
    declared size before anything is decompressed."""
    if not isinstance(blob, list) or len(blob) != 3:
        raise CodecError("bad-tensor", "blob must be [codec, size, data]")
    codec, size, data = blob
    if type(size) is not int or size != expected:
        raise CodecError("bad-tensor", f"blob declares {size!r} bytes, the manifest implies {expected}")
    if not isinstance(data, (bytes, memoryview)):
        raise CodecError("bad-tensor", "blob data must be bytes")
    if isinstance(data, memoryview):  # straight from encode_state, not through msgpack
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    if type(codec) is not int or codec not in (STORED, ZSTD):
        raise CodecError("bad-tensor", f"unknown blob codec {codec!r}")
    if codec == STORED:
        if len(data) != expected:
            raise CodecError("bad-tensor", f"stored blob has {len(data)} bytes, want {expected}")
        return codec, data
    try:
        params = zstd.get_frame_parameters(data)
    except zstd.ZstdError:
        raise CodecError("bad-compression", "blob is not a zstd frame") from None
    if params.content_size != expected:
        raise CodecError("bomb", f"zstd frame declares {params.content_size} bytes, want {expected}")
    return codec, data


def inflate(data: bytes | memoryview, expected: int) -> bytes:
    """Decompress a zstd frame already vetted by check_blob; never produces more than ``expected`` bytes."""
    try:
        out = _decompressor().decompress(data, max_output_size=expected)
    except zstd.ZstdError as exc:
        raise CodecError("bad-compression", f"zstd: {exc}") from None
    if len(out) != expected:
        raise CodecError("bad-compression", f"zstd produced {len(out)} bytes, want {expected}")
    return out


def read_blob(blob: object, expected: int) -> bytes | memoryview:
    """The decoded bytes of a blob that must hold exactly ``expected`` bytes; never decompresses more."""
    codec, data = check_blob(blob, expected)
    return data if codec == STORED else inflate(data, expected)


def _group_view(buf: np.ndarray, n: int, w: int, off: int, g: int) -> np.ndarray:
    """Bytes [off, off + g) of each of the n w-byte elements in ``buf`` as a strided 1-D array."""
    dt = np.dtype(f"u{g}") if g in (1, 2, 4, 8) else np.dtype(f"V{g}")
    return np.ndarray((n,), dtype=dt, buffer=buf, offset=off, strides=(w,))


def _group_blob(
    blobs: list, k: int, arr: np.ndarray, xor: np.ndarray | None, off: int, g: int, level: int
) -> None:
    n, w = arr.size, arr.dtype.itemsize
    src = _group_view(arr.view(np.uint8), n, w, off, g)
    plane = np.empty(n, src.dtype)
    if xor is None:
        np.copyto(plane, src)
    else:  # gather and XOR in one pass: no full-size temporary
        np.bitwise_xor(src, _group_view(xor.view(np.uint8), n, w, off, g), out=plane)
    blobs[k] = make_blob(plane, level, True)


def _low_pair_incompressible(arr: np.ndarray, xor: np.ndarray | None, level: int) -> bool:
    """Does byte 1 of the elements (a sample of them) fail to compress? Then bytes 0-1 travel as one group."""
    m = min(arr.size, _SAMPLE)
    head = arr[:m] if xor is None else arr[:m] ^ xor[:m]
    sample = np.ascontiguousarray(head.view(np.uint8).reshape(m, arr.dtype.itemsize)[:, 1])
    return len(_compressor(level).compress(sample.data)) > _MIN_GAIN * m


def _whole_blob(blobs: list, arr: np.ndarray, xor: np.ndarray | None, level: int, owned: bool) -> None:
    if xor is not None:
        arr, owned = arr ^ xor, True
    blobs[0] = make_blob(arr.data.cast("B"), level, owned)


def pack_array(
    arr: np.ndarray,
    level: int,
    shuffle: bool,
    tasks: list[Task],
    owned: bool = False,
    xor: np.ndarray | None = None,
) -> list:
    """Blobs of a contiguous 1-D array (XOR ``xor`` if given):
    byte-shuffled into byte groups when asked and useful.

    The returned list is filled in by the tasks appended to ``tasks`` (run them with
    broker.wire.threads.run_all before using it). ``owned``: ``arr`` is a private temporary (not the
    caller's tensor) that stored blobs may reference. ``xor``: an unsigned integer array like ``arr``.
    """
    w = arr.dtype.itemsize
    if not shuffle or w == 1 or level == 0 or arr.size < 1024:
        blobs: list = [None]
        tasks.append((arr.nbytes, partial(_whole_blob, blobs, arr, xor, level, owned)))
        return blobs
    n = arr.size
    groups = [2] + [1] * (w - 2) if w == 4 and _low_pair_incompressible(arr, xor, level) else [1] * w
    blobs = [None] * len(groups)
    off = w
    for k in reversed(
        range(len(groups))
    ):  # the top (sign/exponent) plane is the one that compresses: start it first
        g = groups[k]
        off -= g
        tasks.append(
            (
                n * g * (2 if k == len(groups) - 1 else 1),
                partial(_group_blob, blobs, k, arr, xor, off, g, level if g == 1 else 0),
            )
        )
    return blobs


class _Ready:
    """An array's pending decompressions; its assembly waits until all are over (done or failed)."""

    def __init__(self) -> None:
        self.left = 0
        self._lock = threading.Lock()
        self.event = threading.Event()

    def done(self) -> None:
        with self._lock:
            self.left -= 1
            if self.left == 0:
                self.event.set()


class Unpacking:
    """The decode work of a state: decompress blobs, then assemble arrays, as one batch of tasks.

    ``tasks()`` lists every decompression (largest first) before any assembly, and the codec pool runs
    tasks in that order (run_all(ordered=True)); an assembly task waits for its own array's
    decompressions, which have all started by then, so no wait can deadlock. Arrays with least to
    decompress are assembled first, so one thread assembles while another still decompresses a big plane.
    """

    def __init__(self) -> None:
        self.inflate: list[Task] = []
        self.assemble: list[tuple[int, Task]] = []  # (bytes to decompress first, task)

    def tasks(self) -> list[Task]:
        first = sorted(self.inflate, key=lambda t: -t[0])
        return first + [t for _, t in sorted(self.assemble, key=lambda e: e[0])]


Post = Callable[[np.ndarray, int, int], None]


def _inflate_into(slots: list, k: int, data: bytes | memoryview, n: int, ready: _Ready) -> None:
    try:
        slots[k] = inflate(data, n)
    finally:
        ready.done()


def _assemble_block(
    out: np.ndarray,
    typed: np.ndarray,
    planes: list,
    groups: list[tuple[int, np.ndarray]],
    i: int,
    j: int,
    post: Post | None,
    ready: _Ready,
) -> None:
    ready.event.wait()
    for p, (g, dst) in zip(planes, groups):
        if dst.itemsize == g:
            dst[i:j] = np.frombuffer(p, dst.dtype, j - i, i * g)
        else:
            # the lowest group, widened into whole items (a vectorised cast; later groups overwrite the zeros)
            np.copyto(dst[i:j], np.frombuffer(p, f"u{g}", j - i, i * g), casting="unsafe")
    if post is not None:
        post(typed, i, j)


def _assemble_whole(
    res: list, slots: list, dtype: np.dtype, writeable: bool, post: Post | None, ready: _Ready
) -> None:
    ready.event.wait()
    a = np.frombuffer(slots[0], dtype)
    if writeable:  # always a copy: the blob may be the sender's buffer (in-process decode) and post may write
        a = a.copy()
    if post is not None:
        post(a, 0, a.size)
    res[0] = a


def unpack_array(
    blobs: object,
    dtype: npt.DTypeLike,
    n: int,
    work: Unpacking,
    *,
    writeable: bool = False,
    post: Post | None = None,
) -> Callable[[], np.ndarray]:
    """Plan the decoding of ``n`` items of ``dtype`` held by ``blobs`` (as written by pack_array).

    Checks the blob list now (CodecError), appends the work to ``work`` and returns a getter for the 1-D
    array, valid once that work has run. ``post(array, i, j)`` runs on each assembled block of elements
    [i, j) (it may modify them); ``writeable``: the array must not be a read-only view of the message.
    """
    dtype = np.dtype(dtype)
    w = dtype.itemsize
    if not isinstance(blobs, list) or not 1 <= len(blobs) <= w:
        raise CodecError("bad-tensor", f"expected 1 to {w} blobs for {dtype.name} data")
    if len(blobs) == 1:
        codec, data = check_blob(blobs[0], n * w)
        slots: list = [data]
        ready = _Ready()
        if codec == ZSTD:
            ready.left = 1
            work.inflate.append((n * w, partial(_inflate_into, slots, 0, data, n * w, ready)))
        else:
            ready.event.set()
        res: list = [None]
        work.assemble.append(
            (ready.left * n * w, (n * w, partial(_assemble_whole, res, slots, dtype, writeable, post, ready)))
        )
        return lambda: res[0]
    # byte groups, low to high: blob k holds bytes [off, off + g) of every element, g = its size / n
    claimed = [b[1] if isinstance(b, list) and len(b) == 3 else None for b in blobs]
    sizes = [sz for sz in claimed if type(sz) is int and sz > 0 and sz % max(n, 1) == 0]
    if len(sizes) != len(claimed) or sum(sizes) != n * w:
        raise CodecError(
            "bad-tensor", f"blob sizes {claimed!r} do not split {n} {dtype.name} items into byte groups"
        )
    out = np.empty((n, w), np.uint8)
    typed = out.view(dtype).reshape(n)
    planes: list = [None] * len(blobs)
    groups: list[tuple[int, np.ndarray]] = []
    off = 0
    ready = _Ready()
    inflates: list[Task] = []
    for k, (b, sz) in enumerate(zip(blobs, sizes)):
        codec, data = check_blob(b, sz)
        planes[k] = data
        if codec == ZSTD:
            inflates.append((sz, partial(_inflate_into, planes, k, data, sz, ready)))
        g = sz // n
        if off == 0 and g < w and g in (1, 2, 4) and w in (2, 4, 8) and _LITTLE:
            groups.append((g, out.view(f"u{w}").reshape(n)))  # must stay first: assembled in group order
        else:
            groups.append((g, _group_view(out, n, w, off, g)))
        off += g
    ready.left = len(inflates)
    if not inflates:
        ready.event.set()
    work.inflate += inflates
    wait = sum(c for c, _ in inflates)
    for i in range(0, n, _BLOCK):
        j = min(n, i + _BLOCK)
        work.assemble.append(
            (wait, ((j - i) * w, partial(_assemble_block, out, typed, planes, groups, i, j, post, ready)))
        )
    return lambda: typed


_CONVERT_BLOCK = 1 << 18  # elements per bf16 conversion step: its uint32 scratch (1 MiB) stays in L2
_CONVERT_TASK = 1 << 21  # elements per conversion task on the codec threads


def _bf16_range(u: np.ndarray, f: np.ndarray, out: np.ndarray, i: int, j: int) -> None:
    """``out[i:j]``: bfloat16 of float32 bits ``u[i:j]`` (``f``: the same memory as float32), by blocks.

    Per block, in one uint32 scratch: (u >> 16) & 1, + 0x7FFF, + u, then its high halves are the result
    (round to nearest, ties to even, as the carry out of the low half). A block holding a NaN (its minimum is
    NaN) has those items replaced by sign | 0x7FC0, a quiet NaN.
    """
    scratch = np.empty(min(_CONVERT_BLOCK, j - i), np.uint32)
    high = scratch.view(np.uint16)[1::2] if _LITTLE else scratch.view(np.uint16)[0::2]
    for a in range(i, j, _CONVERT_BLOCK):
        b = min(j, a + _CONVERT_BLOCK)
        s, ub = scratch[: b - a], u[a:b]
        np.right_shift(ub, 16, out=s)
        np.bitwise_and(s, 1, out=s)
        s += 0x7FFF
        s += ub
        out[a:b] = high[: b - a]
        if np.isnan(np.minimum.reduce(f[a:b])):
            nan = (ub & 0x7FFFFFFF) > 0x7F800000
            out[a:b][nan] = ((ub[nan] >> 16) & 0x8000).astype(np.uint16) | 0x7FC0


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 ``x``, rounded to nearest even; NaN stays a quiet NaN
    (sign | 0x7FC0). Same shape as ``x``.

    Vectorised in cache-sized blocks with one scratch buffer (no array-sized temporaries), split over the
    codec threads when large; bit-identical to the plain formula ``((u >> 16) & 1) + 0x7FFF + u >> 16``.
    """
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    u = flat.view(np.uint32)
    n = u.size
    out = np.empty(n, np.uint16)
    if n:
        tasks: list[Task] = [
            (
                4 * (min(n, i + _CONVERT_TASK) - i),
                partial(_bf16_range, u, flat, out, i, min(n, i + _CONVERT_TASK)),
            )
            for i in range(0, n, _CONVERT_TASK)
        ]
        run_all(tasks)
    return out.reshape(np.shape(x))


def bf16_to_f32(h: np.ndarray) -> np.ndarray:
    """float32 of bfloat16 bit patterns ``h`` (uint16), exactly: they become the high half, the low half 0.

    Widened and shifted block by block, so the shift runs on what the widening just wrote (in cache)."""
    out = np.empty(np.shape(h), np.uint32)
    flat, src = out.reshape(-1), np.asarray(h).reshape(-1)
    for a in range(0, flat.size, _CONVERT_BLOCK):
        o = flat[a : a + _CONVERT_BLOCK]
        o[...] = src[a : a + _CONVERT_BLOCK]
        o <<= 16
    return out.view(np.float32)


def _row_blocks(rows: int, cols: int) -> list[tuple[int, int, int, int]]:
    """(row0, row1, col0, col1) blocks of about _CONVERT_BLOCK items of a rows × cols matrix."""
    if rows == 1 or cols >= _CONVERT_BLOCK:
        step = _CONVERT_BLOCK
        return [(r, r + 1, c, min(cols, c + step)) for r in range(rows) for c in range(0, cols, step)]
    per = max(1, _CONVERT_BLOCK // max(cols, 1))
    return [(r, min(rows, r + per), 0, cols) for r in range(0, rows, per)]


def quantize_affine(m: np.ndarray, lo: np.ndarray, inv: np.ndarray, top: int) -> np.ndarray:
    """uint8 levels of the rows of float32 ``m`` (rows × cols): rint((m − lo) · inv), clipped to 0..top, flat.

    ``lo`` and ``inv`` (float32, one a row) are the zero point and 1 / scale. Bit-identical to the
    whole-array formula (the same float32 operations, element by element), computed block by block in one
    cache-sized scratch instead of two array-sized temporaries.
    """
    rows, cols = m.shape
    out = np.empty((rows, cols), np.uint8)
    scratch = np.empty(min(_CONVERT_BLOCK, max(rows * cols, 1)), np.float32)
    for r0, r1, c0, c1 in _row_blocks(rows, cols):
        s = scratch[: (r1 - r0) * (c1 - c0)].reshape(r1 - r0, c1 - c0)
        np.subtract(m[r0:r1, c0:c1], lo[r0:r1, None], out=s)
        s *= inv[r0:r1, None]
        np.rint(s, out=s)
        np.clip(s, 0, top, out=s)
        np.copyto(out[r0:r1, c0:c1], s, casting="unsafe")
    return out.reshape(-1)


def dequantize_affine(q: np.ndarray, scale: np.ndarray, lo: np.ndarray, rows: int) -> np.ndarray:
    """float32 ``q · scale + lo`` of uint8 levels ``q`` (flat, ``rows`` rows, one scale and zero point a row),
    flat; bit-identical to the whole-array formula, block by block."""
    cols = q.size // rows if rows else 0
    qm = q.reshape(rows, cols)
    out = np.empty((rows, cols), np.float32)
    for r0, r1, c0, c1 in _row_blocks(rows, cols):
        o = out[r0:r1, c0:c1]
        np.multiply(qm[r0:r1, c0:c1], scale[r0:r1, None], out=o)
        o += lo[r0:r1, None]
    return out.reshape(-1)
