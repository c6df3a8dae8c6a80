"""The blocked conversions of the wire (bf16, threaded; the affine int levels) give the same bits as the
plain whole-array formulas they replaced."""

from __future__ import annotations

import numpy as np
import pytest

from fedmq.broker.wire import blobs
from fedmq.broker.wire.blobs import bf16_to_f32, dequantize_affine, f32_to_bf16, quantize_affine
from fedmq.broker.wire.threads import codec_threads, set_codec_threads


def reference_f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """The conversion as it was written before it was blocked: whole-array temporaries."""
    u = x.view(np.uint32)
    r = (u >> 16) & 1
    r += 0x7FFF
    r += u
    hi = (r >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        hi[nan] = ((u[nan] >> 16) & 0x8000).astype(np.uint16) | 0x7FC0
    return hi


def reference_bf16_to_f32(h: np.ndarray) -> np.ndarray:
    out = h.astype(np.uint32)
    out <<= 16
    return out.view(np.float32)


def _edges() -> np.ndarray:
    """Every bf16 pattern as the high half, with the low halves where rounding decides: 0, 1, just below,
    at and just above the tie, all ones; so every exponent, both signs, ties to odd and even, the largest
    finites that round up to Inf, subnormals, Inf, and quiet and signalling NaNs with and without payload."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    return (hi[:, None] | lows[None, :]).reshape(-1)


def _check(bits: np.ndarray) -> None:
    x = bits.view(np.float32)
    ours, ref = f32_to_bf16(x), reference_f32_to_bf16(x)
    assert ours.dtype == np.uint16 and ours.shape == x.shape
    diff = np.flatnonzero(ours != ref)
    assert diff.size == 0, [(hex(int(bits[i])), hex(int(ours[i])), hex(int(ref[i]))) for i in diff[:5]]


def test_edge_patterns_bit_identical() -> None:
    bits = _edges()
    _check(bits)
    x = bits.view(np.float32)
    out = f32_to_bf16(x)
    # spot checks against hand-worked values: a tie rounds to even, NaN keeps its sign and becomes quiet
    assert out[np.flatnonzero(bits == 0x3F808000)[0]] == 0x3F80
    assert out[np.flatnonzero(bits == 0x3F818000)[0]] == 0x3F82
    assert out[np.flatnonzero(bits == 0x7F7FFFFF)[0]] == 0x7F80
    assert out[np.flatnonzero(bits == 0x7F800001)[0]] == 0x7FC0
    assert out[np.flatnonzero(bits == 0xFF800001)[0]] == 0xFFC0
    assert out[np.flatnonzero(bits == 0xFF800000)[0]] == 0xFF80


@pytest.mark.parametrize("threads", [1, 2])
def test_random_patterns_across_blocks_and_tasks(threads: int) -> None:
    """Uniform random bit patterns (about 0.4 % NaN) over more than two conversion tasks, on one thread
    and on two, and the same data with NaNs only in a few blocks."""
    before = codec_threads()
    set_codec_threads(threads)
    try:
        rng = np.random.default_rng(38)
        n = 2 * blobs._CONVERT_TASK + 12345
        bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
        _check(bits)
        finite = (rng.standard_normal(n) * 0.05).astype(np.float32).view(np.uint32)
        for at in (0, blobs._CONVERT_BLOCK - 1, blobs._CONVERT_BLOCK, blobs._CONVERT_TASK + 7, n - 1):
            finite[at] = 0xFFC12345 if at % 2 else 0x7F800001
        _check(finite)
    finally:
        set_codec_threads(before)


def test_shapes_and_empty() -> None:
    x = np.random.default_rng(1).standard_normal((37, 19)).astype(np.float32)
    assert np.array_equal(f32_to_bf16(x), reference_f32_to_bf16(x))
    assert f32_to_bf16(np.zeros(0, np.float32)).shape == (0,)
    assert bf16_to_f32(np.zeros(0, np.uint16)).shape == (0,)
    h = f32_to_bf16(x)
    assert np.array_equal(bf16_to_f32(h).view(np.uint32), reference_bf16_to_f32(h).view(np.uint32))
    assert bf16_to_f32(h).shape == (37, 19)


def test_bf16_to_f32_every_pattern() -> None:
    """All 65,536 bf16 patterns, and a large array over several blocks, widen to the same float32 bits."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    assert np.array_equal(bf16_to_f32(every).view(np.uint32), reference_bf16_to_f32(every).view(np.uint32))
    big = np.random.default_rng(2).integers(0, 1 << 16, 3 * blobs._CONVERT_BLOCK + 5).astype(np.uint16)
    assert np.array_equal(bf16_to_f32(big).view(np.uint32), reference_bf16_to_f32(big).view(np.uint32))
    # a bf16 value converts back to itself; NaNs come back as quiet NaNs of their sign
    back = f32_to_bf16(bf16_to_f32(every))
    nan = (every & 0x7FFF) > 0x7F80
    assert np.array_equal(back[~nan], every[~nan])
    assert np.array_equal(back[nan], (every[nan] & 0x8000) | 0x7FC0)


def reference_quantize(m: np.ndarray, lo: np.ndarray, inv: np.ndarray, top: int) -> np.ndarray:
    q = m - lo[:, None]
    q *= inv[:, None]
    np.rint(q, out=q)
    np.clip(q, 0, top, out=q)
    return q.astype(np.uint8).reshape(-1)


def reference_dequantize(q: np.ndarray, scale: np.ndarray, lo: np.ndarray, rows: int) -> np.ndarray:
    d = np.empty((rows, q.size // rows if rows else 0), np.float32)
    np.multiply(q.reshape(d.shape), scale[:, None], out=d)
    d += lo[:, None]
    return d.reshape(-1)


@pytest.mark.parametrize("top", [255, 63, 31, 15])
@pytest.mark.parametrize(
    "shape",
    # one row (per tensor) over several blocks, many short rows (per row), few rows longer than a block,
    # and empty ones
    [(1, 3 * blobs._CONVERT_BLOCK + 11), (5003, 200), (3, blobs._CONVERT_BLOCK + 5), (1, 0), (4, 0), (1, 1)],
)
def test_affine_levels_bit_identical(shape: tuple[int, int], top: int) -> None:
    rng = np.random.default_rng(top + shape[0])
    m = (rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 3, (shape[0], 1))).astype(np.float32)
    if m.size:
        # exact ties of the rounding (x.5 levels) and the extremes of each row
        m.reshape(-1)[:: max(1, m.size // 64)] = 0.5
    rows = shape[0]
    lo = m.min(axis=1) if m.size else np.zeros(rows, np.float32)
    hi = m.max(axis=1) if m.size else np.zeros(rows, np.float32)
    scale = ((hi.astype(np.float64) - lo) / float(top)).astype(np.float32)
    scale[scale <= 0] = 1.0
    inv = (1.0 / scale.astype(np.float64)).astype(np.float32)
    ours = quantize_affine(m, lo, inv, top)
    ref = reference_quantize(m, lo, inv, top)
    assert ours.dtype == np.uint8 and np.array_equal(ours, ref)
    # levels just outside 0..top (a zero point above the row's minimum) are clipped the same way
    assert np.array_equal(quantize_affine(m, lo + 1, inv, top), reference_quantize(m, lo + 1, inv, top))
    back, back_ref = dequantize_affine(ours, scale, lo, rows), reference_dequantize(ref, scale, lo, rows)
    assert back.dtype == np.float32 and np.array_equal(back.view(np.uint32), back_ref.view(np.uint32))
