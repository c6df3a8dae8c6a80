"""The blocked, threaded bf16 conversions give the same bits as the plain formulas they replaced."""

from __future__ import annotations

import numpy as np
import pytest

from fedmq.broker.wire import blobs
from fedmq.broker.wire.blobs import bf16_to_f32, f32_to_bf16
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
