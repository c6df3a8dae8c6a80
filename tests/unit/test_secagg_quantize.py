"""Fixed-point quantization into Z_{2^32} (fedmq/secagg/quantize.py): the bits chosen from the number of
clients, the error of a decoded sum against its bound, unbiased rounding, weighted means, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from fedmq.errors import SecAggError
from fedmq.secagg.quantize import MIN_BITS, Quantizer, max_bits


def test_bits_leave_room_for_the_sum_of_m_clients():
    assert [max_bits(m) for m in (1, 2, 10, 16, 17, 100, 1000)] == [32, 31, 28, 28, 27, 25, 22]
    for m in (10, 100, 1000):
        assert m * 2 ** max_bits(m) <= 2**32 < m * 2 ** (max_bits(m) + 1)
    with pytest.raises(SecAggError, match=r"overflow: 29 bits a coordinate for 10 clients"):
        Quantizer(clip=1.0, bits=29, clients=10)
    with pytest.raises(SecAggError, match="overflow"):
        Quantizer.for_clients(2**25, 1.0)  # would leave 7 bits
    assert Quantizer.for_clients(2**24, 1.0).bits == MIN_BITS


@pytest.mark.parametrize("m", [10, 100])
def test_a_sum_of_m_worst_case_encodings_does_not_wrap(m):
    q = Quantizer.for_clients(m, 0.5)
    top = q.encode(np.full(3, 9.0), np.random.default_rng(0))  # clipped to c: the largest value, 2^b - 1
    assert int(top[0]) == q.levels
    total = np.zeros(3, np.uint32)
    for _ in range(m):
        total += top
    assert np.allclose(q.decode_sum(total, m), m * 0.5)


def test_a_decoded_sum_is_within_m_steps_of_the_sum_of_clipped_inputs():
    m, clip = 10, 0.05
    q = Quantizer.for_clients(m, clip)  # b = 28, step = 2c / (2^28 - 1) ≈ 3.7e-10
    rng = np.random.default_rng(1)
    xs = [rng.normal(0, 0.03, 5000).astype(np.float32) for _ in range(m)]  # some beyond ±c
    total = np.zeros(5000, np.uint32)
    for x in xs:
        total += q.encode(x, rng)
    exact = sum(np.clip(x.astype(np.float64), -clip, clip) for x in xs)
    error = np.abs(q.decode_sum(total, m) - exact).max()
    assert error < q.error_bound(m) == m * 2 * clip / (2**28 - 1)


def test_stochastic_rounding_is_unbiased():
    q = Quantizer(clip=1.0, bits=8, clients=1)  # a coarse step: 2/255
    x = np.full(200_000, 0.3 * q.step - 1.0)  # 0.3 of a step above the bottom level
    codes = q.encode(x, np.random.default_rng(2))
    assert set(np.unique(codes)) == {0, 1}
    # the mean code is 0.3 within 5 standard deviations of a Bernoulli(0.3) mean over 200 000 draws
    assert abs(codes.mean() - 0.3) < 5 * (0.3 * 0.7 / 200_000) ** 0.5


def test_weighted_updates_sum_to_a_weighted_mean():
    q = Quantizer.for_clients(3, 1.0)
    rng = np.random.default_rng(3)
    xs = [rng.uniform(-1, 1, 100) for _ in range(3)]
    weights = [1.0, 0.5, 0.25]  # n_k / n_max, times a staleness weight in asynchronous buffers
    total = np.zeros(101, np.uint32)
    for x, w in zip(xs, weights):
        total += q.encode_weighted(x, w, rng)
    mean, weight = q.decode_weighted_mean(total, 3)
    assert abs(weight - 1.75) <= 3 / q.levels
    expected = sum(w * x for x, w in zip(xs, weights)) / 1.75
    # numerator within 3 steps, divided by a weight sum within 3 levels of 1.75
    assert np.abs(mean - expected).max() < (q.error_bound(3) + 3 / q.levels * 3) / (1.75 - 3 / q.levels)


def test_bad_inputs_are_refused_in_one_line():
    q = Quantizer.for_clients(4, 1.0)
    rng = np.random.default_rng(4)
    cases = [
        (lambda: q.encode(np.array([0.0, np.nan]), rng), "non-finite"),
        (lambda: q.encode_weighted(np.zeros(2), 1.5, rng), "bad-parameter: a weight"),
        (lambda: q.decode_sum(np.zeros(2, np.uint32), 5), "bad-parameter: a sum of 5 inputs"),
        (lambda: q.decode_sum(np.zeros(2, np.int64), 2), "bad-length"),
        (lambda: q.decode_weighted_mean(np.zeros(3, np.uint32), 2), "zero-weight"),
        # two inputs of b bits reach at most 2 · (2^b - 1): more is a client outside the range
        (lambda: q.decode_sum(np.array([0, 2 * q.levels + 1], np.uint32), 2), "out-of-range"),
        (lambda: Quantizer(clip=float("inf"), bits=20, clients=4), "clipping range"),
    ]
    for call, message in cases:
        with pytest.raises(SecAggError, match=message) as caught:
            call()
        assert "\n" not in str(caught.value)


def test_chunked_codes_are_the_whole_vectors_rounding():
    """The quantizer works a chunk at a time (prg.CHUNK); its codes are floor((f·clip(x) + c) / step + u) with
    the draws u in the vector's order, the weight's drawn first, as one pass over the whole vector gives."""
    from fedmq.secagg.prg import CHUNK

    q = Quantizer.for_clients(100, 0.5)
    x = np.random.default_rng(3).standard_normal(2 * CHUNK + 7).astype(np.float32)
    got = q.encode_weighted(x, 0.6, np.random.default_rng(4), 0.5)
    rng = np.random.default_rng(4)
    w = np.floor(0.6 * q.levels + rng.random())
    y = (np.clip(x.astype(np.float64), -0.5, 0.5) * (0.6 * 0.5) + 0.5) / q.step + rng.random(x.size)
    assert np.array_equal(got, np.append(np.floor(y), w).astype(np.uint32))
    bad = x.copy()
    bad[-1] = np.nan  # in the last chunk
    with pytest.raises(SecAggError, match="non-finite"):
        q.encode(bad, np.random.default_rng(0))
