"""The codec's worker threads: same bytes and arrays as single-threaded, ordered errors, fork safety."""

from __future__ import annotations

import multiprocessing
import threading

import msgpack
import numpy as np
import pytest
import zstandard as zstd
from load_factor import budget

from fedmq.broker.wire import threads as ct
from fedmq.broker.wire.blobs import PLANE_PARAMS, ZSTD, make_blob
from fedmq.broker.wire.encodings import EncodingSpec, decode_state, encode_state
from fedmq.broker.wire.envelope import Envelope, Kind, pack, unpack
from fedmq.errors import CodecError
from fedmq.manifest import Manifest


def _big_state(seed: int = 0) -> dict[str, np.ndarray]:
    """~5 MB of trained-like weights in tensors of mixed sizes: large enough for the thread pool."""
    rng = np.random.default_rng(seed)
    return {
        "emb": (rng.standard_normal((3000, 300), dtype=np.float32) * np.float32(0.05)),
        "w": (rng.standard_normal((600, 300), dtype=np.float32) * np.float32(0.1)),
        "b": rng.standard_normal(600, dtype=np.float32) * np.float32(0.01),
        "one": np.array([2.5], np.float32),
    }


BIG = _big_state()
BIG_BASE = {k: v + np.float32(1e-3) for k, v in BIG.items()}
BIG_MAN = Manifest.from_arrays(BIG)


@pytest.fixture
def threads():
    """Restore the default thread count after a test that changes it."""
    yield ct.set_codec_threads
    ct.set_codec_threads(ct._default_threads())


def _wire(text: str, base=None) -> bytes:
    env = Envelope(
        Kind.UPDATE,
        "j",
        1,
        "c",
        0,
        {"tensors": encode_state(BIG, EncodingSpec.parse(text), base)},
        msg_id="m",
        sent_at=1.0,
    )
    return pack(env)


@pytest.mark.parametrize(
    "text", ["raw", "delta+raw", "bf16", "int8-row", "delta+topk:0.01", "raw,noshuffle", "raw@3"]
)
def test_threaded_codec_is_identical_to_single_threaded(text: str, threads) -> None:
    base = BIG_BASE if text.startswith("delta") else None
    threads(1)
    wire1 = _wire(text, base)
    out1 = decode_state(unpack(wire1).payload["tensors"], BIG_MAN, base)
    threads(2)
    wire2 = _wire(text, base)
    out2 = decode_state(unpack(wire2).payload["tensors"], BIG_MAN, base)
    assert wire1 == wire2
    assert all(out1[k].tobytes() == out2[k].tobytes() for k in BIG)
    if text.startswith("raw") or text == "delta+raw":
        assert all(out2[k].tobytes() == BIG[k].tobytes() for k in BIG)  # bit-exact


def test_threaded_decode_rejects_and_returns_nothing(threads) -> None:
    threads(2)
    obj = msgpack.unpackb(msgpack.packb(encode_state(BIG, EncodingSpec.parse("raw"))))
    rec = obj["t"][0]
    blob = next(b for b in rec["p"] if b[0] == ZSTD)
    blob[2] = blob[2][:-20] + bytes(20)  # valid frame header, corrupt data
    with pytest.raises(CodecError) as e:
        decode_state(obj, BIG_MAN)
    assert e.value.reason == "bad-compression"
    bad = {k: v.copy() for k, v in BIG.items()}
    bad["emb"][2999, 299] = np.nan  # in the last assembly block
    with pytest.raises(CodecError) as e:
        decode_state(encode_state(bad, EncodingSpec()), BIG_MAN)
    assert e.value.reason == "non-finite" and "'emb'" in str(e.value)


def test_run_all_order_and_first_error(threads) -> None:
    threads(2)
    big = ct.INLINE_BELOW  # force the pool
    done = []
    lock = threading.Lock()

    def task(i: int):
        def fn():
            with lock:
                done.append(i)
            if i in (2, 4):
                raise ValueError(f"task {i}")
            return i * i

        return fn

    assert ct.run_all([(big, task(i)) for i in (0, 1, 3)]) == [0, 1, 9]
    done.clear()
    with pytest.raises(ValueError, match="task 2"):
        ct.run_all([(big * (i + 1), task(i)) for i in range(6)])  # largest first, error of the earliest task
    assert sorted(done) == list(range(6))  # every task ran before the error surfaced


def test_set_codec_threads_validates(threads) -> None:
    for bad in (0, -1, 65, 1.5, "2", True):
        with pytest.raises(ValueError):
            threads(bad)
    threads(3)
    assert ct.codec_threads() == 3


def _child(q) -> None:
    out = decode_state(encode_state(BIG, EncodingSpec()), BIG_MAN)
    q.put(all(out[k].tobytes() == BIG[k].tobytes() for k in BIG))


def test_pool_works_in_forked_child(threads) -> None:
    threads(2)
    decode_state(encode_state(BIG, EncodingSpec()), BIG_MAN)  # the parent's pool exists now
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    try:
        assert q.get(timeout=60) is True
    finally:
        p.join(timeout=budget(30))
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0


def test_plane_frames_are_plain_zstd_with_content_size() -> None:
    plane = (BIG["emb"].view(np.uint8).reshape(-1, 4)[:, 3]).copy()
    blob = make_blob(plane, 1, owned=True)
    assert blob[0] == ZSTD and len(blob[2]) < 0.5 * plane.size  # the sign/exponent plane compresses > 2x
    assert zstd.get_frame_parameters(blob[2]).content_size == plane.size
    assert zstd.ZstdDecompressor().decompress(blob[2]) == plane.tobytes()
    assert set(PLANE_PARAMS) >= {"min_match", "hash_log", "strategy"}


def test_codec_benchmark_reports_table_threads_and_load(capsys, threads) -> None:
    from fedmq.benchmarks.codec import main

    main(["--models", "gru-tied", "--encodings", "raw,delta+int8", "--repeats", "1", "--threads", "2"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| gru-tied |")]
    assert [r.split("|")[2].strip() for r in rows] == ["torch.save", "msgpack raw bytes", "raw", "delta+int8"]
    raw = rows[2].split("|")
    assert raw[8].strip() == "0 (exact)" and float(raw[5].strip().rstrip("×")) > 1.1
    assert "codec threads 2; load average" in out and "process CPU" in out


def test_concurrent_callers_share_the_pool(threads) -> None:
    """Several threads encoding and decoding at once (an aggregator's consumers) get their own results."""
    threads(2)
    states = [_big_state(seed) for seed in range(4)]
    results: list = [None] * 4

    def work(i: int) -> None:
        wire = pack(
            Envelope(Kind.UPDATE, "j", 1, "c", 0, {"tensors": encode_state(states[i], EncodingSpec())})
        )
        results[i] = decode_state(unpack(wire).payload["tensors"], BIG_MAN)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=budget(60))
    assert all(results[i][k].tobytes() == states[i][k].tobytes() for i in range(4) for k in BIG)
