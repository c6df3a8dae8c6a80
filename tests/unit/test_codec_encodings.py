"""Tensor encodings: round trips with asserted error bounds, manifest checks, bombs, and fuzzing."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import torch
import zstandard as zstd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedmq.broker.wire.blobs import bf16_to_f32, f32_to_bf16, pack_array
from fedmq.broker.wire.encodings import EncodingSpec, decode_state, encode_state, raw_nbytes
from fedmq.broker.wire.threads import run_all
from fedmq.errors import CodecError
from fedmq.manifest import Manifest


def _state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "emb.weight": (rng.standard_normal((300, 64)) * 0.05 * rng.uniform(0.5, 2, (300, 1))).astype(
            np.float32
        ),
        "rnn.weight": (rng.standard_normal((96, 32)) * 0.1).astype(np.float32),
        "rnn.bias": rng.standard_normal(96).astype(np.float32),
        "scalar": np.array(1.25, np.float32),
        "empty": np.zeros((0, 3), np.float32),
    }


STATE = _state()
BASE = {
    k: (v - (np.random.default_rng(1).standard_normal(v.shape) * 1e-3)).astype(np.float32)
    for k, v in STATE.items()
}
MANIFEST = Manifest.from_arrays(STATE)


def _roundtrip(spec: EncodingSpec, state=STATE, base=None, manifest=MANIFEST) -> tuple[dict, int]:
    wire = msgpack.packb(encode_state(state, spec, base), use_bin_type=True)
    return decode_state(msgpack.unpackb(wire, raw=False), manifest, base), len(wire)


@pytest.mark.parametrize(
    "text",
    [
        "raw",
        "fp16",
        "bf16",
        "int8",
        "int8-row",
        "topk:0.01",
        "delta+raw",
        "delta+int8",
        "delta+topk:0.05",
        "raw@3",
        "raw@0",
        "bf16,noshuffle",
        "delta+fp16@-1",
    ],
)
def test_parse_str_roundtrip(text: str) -> None:
    spec = EncodingSpec.parse(text)
    assert str(spec) == text and EncodingSpec.parse(str(spec)) == spec


def test_parse_fields() -> None:
    s = EncodingSpec.parse("delta+topk:0.05")
    assert (s.kind, s.delta, s.density) == ("topk", True, 0.05)
    assert EncodingSpec.parse("int8-row").per_row and EncodingSpec.parse("raw@0").level == 0


@pytest.mark.parametrize(
    "text", ["", "zip", "topk:abc", "topk:0", "topk:1.5", "int8:0.1", "raw@99", "delta+", "raw+delta", 5]
)
def test_parse_rejects(text) -> None:
    with pytest.raises(CodecError) as e:
        EncodingSpec.parse(text)
    assert e.value.reason == "bad-encoding"


def test_raw_bit_exact_also_as_delta_and_for_torch() -> None:
    for spec in (
        EncodingSpec(),
        EncodingSpec(level=0),
        EncodingSpec(shuffle=False),
        EncodingSpec(delta=True),
    ):
        out, _ = _roundtrip(spec, base=BASE if spec.delta else None)
        assert set(out) == set(STATE)
        for k, v in STATE.items():
            assert out[k].dtype == np.float32 and out[k].shape == v.shape
            assert out[k].tobytes() == v.tobytes(), (spec, k)
            assert out[k].flags.writeable
    tstate = {k: torch.from_numpy(v.copy()) for k, v in STATE.items()}
    out, _ = _roundtrip(EncodingSpec(), tstate, manifest=Manifest.from_arrays(tstate))
    assert all(out[k].tobytes() == STATE[k].tobytes() for k in STATE)


def test_raw_compresses_trained_like_weights() -> None:
    rng = np.random.default_rng(3)
    w = {"w": (rng.standard_normal((512, 512)) * 0.05).astype(np.float32)}
    _, n = _roundtrip(EncodingSpec(), w, manifest=Manifest.from_arrays(w))
    assert n < raw_nbytes(w) / 1.1  # sign/exponent plane compresses; mantissa planes are stored


def test_fp16_bound() -> None:
    out, n = _roundtrip(EncodingSpec(kind="fp16"))
    for k, v in STATE.items():
        # round to nearest: relative error <= 2^-11 for normals, absolute 2^-25 in the subnormal range
        assert np.all(np.abs(out[k] - v) <= np.abs(v) * 2.0**-11 + 2.0**-25)
    assert n < raw_nbytes(STATE) / 1.9


def test_bf16_matches_torch_and_bound() -> None:
    rng = np.random.default_rng(5)
    x = np.concatenate(
        [
            rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 10000),
            np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, 1e-45], np.float32),
        ]
    ).astype(np.float32)
    ours = f32_to_bf16(x)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, ref)
    nan = f32_to_bf16(np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(bf16_to_f32(nan)).all()
    out, n = _roundtrip(EncodingSpec(kind="bf16"))
    for k, v in STATE.items():
        assert np.all(np.abs(out[k] - v) <= np.abs(v) * 2.0**-8)
    assert n < raw_nbytes(STATE) / 2.0


@pytest.mark.parametrize("kind,levels", [("int8", 255), ("int6", 63), ("int5", 31), ("int4", 15)])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("delta", [False, True])
def test_affine_bound(kind: str, levels: int, per_row: bool, delta: bool) -> None:
    spec = EncodingSpec(kind=kind, per_row=per_row, delta=delta)
    out, n = _roundtrip(spec, base=BASE if delta else None)
    for k, v in STATE.items():
        d = (v - BASE[k]) if delta else v
        if d.size == 0:
            continue
        m = d.reshape(d.shape[0], -1) if (per_row and d.ndim >= 2) else d.reshape(1, -1)
        half_step = ((m.max(1) - m.min(1)) / levels / 2)[:, None]
        err = np.abs(out[k] - v).reshape(m.shape)
        assert np.all(err <= half_step * 1.001 + 1e-6 * np.abs(v).reshape(m.shape) + 1e-9), (k, err.max())
    ratio = 3.0 if per_row else 3.5  # per-row pays 8 bytes of scale+zero per row
    # int4: two values a byte; int6/int5: one a byte, which zstd's entropy stage packs into about 6/5 bits
    assert n < raw_nbytes(STATE) / (ratio * {"int8": 1, "int6": 1.2, "int5": 1.4, "int4": 1.8}[kind])


def test_int4_odd_sizes_and_text_form() -> None:
    s = {
        "odd": np.arange(7, dtype=np.float32),
        "one": np.ones(1, np.float32),
        "none": np.zeros(0, np.float32),
    }
    out, _ = _roundtrip(EncodingSpec.parse("int4-row"), s, manifest=Manifest.from_arrays(s))
    assert np.allclose(out["odd"], s["odd"], atol=7 / 15 / 2 + 1e-6) and out["none"].shape == (0,)
    assert str(EncodingSpec.parse("delta+int4-row")) == "delta+int4-row"


def test_int5_and_int6_refuse_values_above_their_top_level() -> None:
    s = {"w": np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)}
    man = Manifest.from_arrays(s)
    for kind, top in (("int5-row", 31), ("int6", 63)):
        obj = encode_state(s, EncodingSpec.parse(kind), None)
        rec = obj["t"][0]
        q = np.full(64, top + 1, np.uint8)  # one level too high: would decode above the row's maximum
        tasks: list = []
        rec["p"] = pack_array(q, 1, False, tasks, owned=True)
        run_all(tasks)
        with pytest.raises(CodecError, match="above its top level"):
            decode_state(msgpack.unpackb(msgpack.packb(obj)), man)
    assert (
        str(EncodingSpec.parse("delta+int5-row")) == "delta+int5-row"
        and str(EncodingSpec.parse("int6")) == "int6"
    )


def test_int8_constant_tensor() -> None:
    s = {"c": np.full((4, 5), 0.3, np.float32)}
    out, _ = _roundtrip(EncodingSpec(kind="int8", per_row=True), s, manifest=Manifest.from_arrays(s))
    assert np.allclose(out["c"], 0.3, atol=1e-7)


@pytest.mark.parametrize("delta", [False, True])
def test_topk_keeps_largest(delta: bool) -> None:
    density = 0.05
    spec = EncodingSpec(kind="topk", density=density, delta=delta)
    out, n = _roundtrip(spec, base=BASE if delta else None)
    for k, v in STATE.items():
        d = (v - BASE[k]) if delta else v
        got = (out[k] - BASE[k]) if delta else out[k]
        if d.size == 0:
            continue
        kk = max(1, math.ceil(density * d.size))
        kept = got != 0
        assert kept.sum() == kk or (kept.sum() < kk and np.sum(d != 0) < kk), k
        # every kept entry is at least as large as every dropped one, kept values carry fp16 error only
        if kept.sum() < d.size and kept.any():
            assert np.abs(d[kept]).min() >= np.abs(d[~kept]).max()
        assert np.all(np.abs(got[kept] - d[kept]) <= np.abs(d[kept]) * 2.0**-11 + 1e-6)
        if not delta:
            assert np.all(got[~kept] == 0)
    assert n < raw_nbytes(STATE) / 8


def test_topk_fp32_fallback_for_large_values() -> None:
    s = {"w": np.array([1e6, -3.0, 2e5, 0.1], np.float32)}
    out, _ = _roundtrip(EncodingSpec(kind="topk", density=0.5), s, manifest=Manifest.from_arrays(s))
    assert out["w"].tolist() == [1e6, 0.0, 2e5, 0.0]


@pytest.mark.parametrize(
    "text", ["raw", "raw@0", "raw,noshuffle", "bf16", "delta+raw", "int8-row", "topk:0.1"]
)
def test_direct_decode_without_msgpack_and_no_aliasing(text: str) -> None:
    """encode_state's dict decodes as is (in-process); later changes to the source do not leak into it."""
    spec = EncodingSpec.parse(text)
    src = {k: v.copy() for k, v in STATE.items()}
    obj = encode_state(src, spec, BASE if spec.delta else None)
    for v in src.values():
        v[...] = 7.0
    out = decode_state(obj, MANIFEST, BASE if spec.delta else None)
    expect, _ = _roundtrip(spec, base=BASE if spec.delta else None)
    assert all(np.array_equal(out[k], expect[k]) for k in STATE)


def test_tune_allocator_is_idempotent() -> None:
    """Run in a child process: the tuning is process-global and must not leak into this test session."""
    import subprocess
    import sys
    from pathlib import Path

    code = "from fedmq.broker.wire.malloc import tune_allocator as t; a = t(); assert t() is a; print(a)"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]  # structlog may log to stdout before it
    assert last == "True" if sys.platform == "linux" else last in ("True", "False")


def test_release_free_gives_a_freed_buffer_back_only_once_tuned() -> None:
    """In a child process: not tuned, nothing is done; tuned, a freed 64 MiB buffer stays in the heap until
    release_free gives its pages back (glibc's malloc_trim says it released memory)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "from fedmq.broker.wire.malloc import release_free as r, tune_allocator as t\n"
        "before = r(); tuned = t(); b = bytearray(64 << 20); del b\n"
        "print(before, tuned, r())"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
    assert proc.returncode == 0, proc.stderr
    before, tuned, released = proc.stdout.strip().splitlines()[-1].split()
    assert before == "False"
    assert released == tuned if sys.platform == "linux" else released in ("True", "False")


def test_subset_of_manifest() -> None:
    sub = {"rnn.bias": STATE["rnn.bias"]}
    out, _ = _roundtrip(EncodingSpec(kind="bf16"), sub)
    assert list(out) == ["rnn.bias"]


def _enc(spec: str = "raw", state=STATE, base=None) -> dict:
    return msgpack.unpackb(msgpack.packb(encode_state(state, EncodingSpec.parse(spec), base)))


def _reason(obj, manifest=MANIFEST, base=None, **kw) -> str:
    with pytest.raises(CodecError) as e:
        decode_state(obj, manifest, base, **kw)
    return e.value.reason


def test_manifest_mismatches() -> None:
    other = Manifest.from_arrays({k: v for k, v in STATE.items() if k != "scalar"})
    assert _reason(_enc(), other) == "unknown-tensor"
    wrong_shape = Manifest.from_arrays({**STATE, "rnn.bias": np.zeros(97, np.float32)})
    assert _reason(_enc(), wrong_shape) == "shape-mismatch"
    wrong_dtype = Manifest.from_arrays({**STATE, "rnn.bias": np.zeros(96, np.float16)})
    assert _reason(_enc(), wrong_dtype) == "dtype-mismatch"
    obj = _enc()
    obj["t"].append(obj["t"][0])
    assert _reason(obj) == "duplicate-tensor"
    assert _reason(_enc(), max_bytes=1000) == "too-large"
    assert _reason(_enc(), max_tensors=2) == "too-large"


def test_delta_needs_base() -> None:
    with pytest.raises(CodecError) as e:
        encode_state(STATE, EncodingSpec.parse("delta+int8"))
    assert e.value.reason == "missing-base"
    obj = _enc("delta+int8", base=BASE)
    assert _reason(obj) == "missing-base"
    assert _reason(obj, base={k: v for k, v in BASE.items() if k != "rnn.bias"}) == "missing-base"
    assert _reason(obj, base={**BASE, "rnn.bias": np.zeros(3, np.float32)}) == "bad-base"


def test_nonfinite_rejection() -> None:
    bad = {**STATE, "rnn.bias": STATE["rnn.bias"].copy()}
    bad["rnn.bias"][3] = np.nan
    bad["rnn.weight"] = STATE["rnn.weight"].copy()
    bad["rnn.weight"][0, 0] = np.inf
    for spec in ("raw", "fp16", "bf16"):
        obj = _enc(spec, bad)
        assert _reason(obj) == "non-finite"
        out = decode_state(obj, MANIFEST, reject_nonfinite=False)
        assert np.isnan(out["rnn.bias"][3]) and np.isinf(out["rnn.weight"][0, 0])
    for spec in ("int8", "topk:0.1"):
        with pytest.raises(CodecError) as e:
            encode_state(bad, EncodingSpec.parse(spec))
        assert e.value.reason == "non-finite"


def test_zstd_bomb_and_blob_lies() -> None:
    obj = _enc("raw")
    rec = next(r for r in obj["t"] if r["n"] == "emb.weight")
    n = rec["p"][0][1]  # bytes of the first byte group (2 or 1 per element)
    huge = zstd.ZstdCompressor(level=19).compress(bytes(64 << 20))  # tiny frame declaring 64 MiB
    rec["p"] = [[1, n, huge]] + rec["p"][1:]
    assert _reason(obj) == "bomb"
    obj = _enc("raw")
    rec = next(r for r in obj["t"] if r["n"] == "emb.weight")
    rec["p"][0][1] = 1 << 40  # declared size disagrees with the manifest
    assert _reason(obj) == "bad-tensor"
    obj = _enc("raw")
    rec = next(r for r in obj["t"] if r["n"] == "emb.weight")
    n = rec["p"][0][1]
    unknown = zstd.ZstdCompressor(write_content_size=False).compress(bytes(n))
    rec["p"] = [[1, n, unknown]] + rec["p"][1:]
    assert _reason(obj) == "bomb"


def test_topk_bad_indices() -> None:
    obj = _enc("topk:0.1", {"w": np.arange(1, 101, dtype=np.float32)})
    man = Manifest.from_arrays({"w": np.zeros(100, np.float32)})
    rec = obj["t"][0]
    diffs = np.zeros(10, np.uint32)  # repeated index 0
    rec["i"] = [[0, 40, diffs.tobytes()]]
    assert _reason(obj, man) == "bad-tensor"
    rec["i"] = [[0, 40, np.full(10, 20, np.uint32).tobytes()]]  # runs past the end
    assert _reason(obj, man) == "bad-tensor"
    rec["k"] = 101
    assert _reason(obj, man) == "bad-tensor"


def test_unknown_format_and_encoding() -> None:
    obj = _enc()
    obj["fmt"] = 3
    assert _reason(obj) == "unknown-version"
    obj = _enc()
    obj["t"][0]["e"] = "lz4"
    assert _reason(obj) == "unknown-encoding"
    assert _reason([1, 2]) == "malformed"


def test_decode_is_all_or_nothing() -> None:
    obj = _enc("raw")
    obj["t"][-1]["p"][0][2] = b"\x00"  # the last tensor is corrupt; no dict comes back at all
    with pytest.raises(CodecError):
        decode_state(obj, MANIFEST)


SMALL = {
    "a": (np.random.default_rng(9).standard_normal((40, 30)) * 0.05).astype(np.float32),
    "b": np.linspace(-1, 1, 7, dtype=np.float32),
}
SMALL_BASE = {k: v * 0.99 for k, v in SMALL.items()}
SMALL_MAN = Manifest.from_arrays(SMALL)
SMALL_WIRES = [
    msgpack.packb(encode_state(SMALL, EncodingSpec.parse(t), SMALL_BASE))
    for t in (
        "raw",
        "fp16",
        "bf16",
        "int8-row",
        "int6-row",
        "int5-row",
        "int4-row",
        "topk:0.1",
        "delta+raw",
        "delta+int8",
        "delta+int5",
        "delta+int4",
        "delta+topk:0.2",
        "raw@0",
    )
]


def _check_valid(out: dict) -> None:
    for k, v in out.items():
        assert k in SMALL and v.shape == SMALL[k].shape and v.dtype == np.float32 and np.isfinite(v).all()


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_decode_state(data: st.DataObject) -> None:
    """Truncated, bit-flipped and random wire bytes: a valid state or CodecError, nothing else."""
    wire = data.draw(st.sampled_from(SMALL_WIRES))
    mode = data.draw(st.sampled_from(["flip", "truncate", "random"]))
    if mode == "flip":
        b = bytearray(wire)
        for _ in range(data.draw(st.integers(1, 3))):
            i = data.draw(st.integers(0, len(b) - 1))
            b[i] ^= 1 << data.draw(st.integers(0, 7))
        wire = bytes(b)
    elif mode == "truncate":
        wire = wire[: data.draw(st.integers(0, len(wire) - 1))]
    else:
        wire = data.draw(st.binary(max_size=200))
    try:
        obj = msgpack.unpackb(wire, raw=False, strict_map_key=False, max_ext_len=0)
    except Exception:
        obj = data.draw(
            st.recursive(
                st.none() | st.integers() | st.binary(max_size=8) | st.text(max_size=4),
                lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=4),
                max_leaves=12,
            )
        )
    try:
        out = decode_state(obj, SMALL_MAN, SMALL_BASE)
    except CodecError as e:
        assert e.reason
        return
    _check_valid(out)


@pytest.mark.parametrize(
    "text",
    [
        "raw",
        "delta+raw",
        "fp16",
        "delta+fp16",
        "bf16",
        "delta+bf16",
        "int8-row",
        "delta+int8",
        "int4-row",
        "delta+int4",
        "topk:0.05",
        "delta+topk:0.05",
        "raw,noshuffle",
    ],
)
def test_as_delta_is_decoded_minus_base(text: str) -> None:
    """What the aggregator folds: θ − base in one pass, equal to decoding θ and subtracting the base."""
    obj = _enc(text, base=BASE)
    full = decode_state(obj, MANIFEST, BASE)
    deltas = decode_state(obj, MANIFEST, BASE, as_delta=True)
    assert list(deltas) == list(full)
    for name, d in deltas.items():
        np.testing.assert_allclose(
            d, full[name] - BASE[name], rtol=0, atol=1e-6 * max(1.0, float(np.abs(full[name]).max(initial=0)))
        )
    if (
        text == "delta+raw"
    ):  # the raw XOR delta yields θ bit-exactly, so θ − base is exactly float32 subtraction
        for name, d in deltas.items():
            assert np.array_equal(d, STATE[name] - BASE[name])


def test_as_delta_needs_the_base_and_still_rejects_nan() -> None:
    assert _reason(_enc("raw"), as_delta=True) == "missing-base"
    partial = {k: v for k, v in BASE.items() if k != "rnn.bias"}
    assert _reason(_enc("raw"), base=partial, as_delta=True) == "missing-base"
    bad = {**STATE, "rnn.bias": np.full(96, np.nan, np.float32)}
    assert _reason(_enc("raw", state=bad), base=BASE, as_delta=True) == "non-finite"
    assert _reason(_enc("fp16", state=bad), base=BASE, as_delta=True) == "non-finite"


def test_a_trimmer_gives_the_free_pages_back_at_every_nth_freed_buffer_counted_across_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    from fedmq.broker.wire import malloc

    returns: list[int] = []
    monkeypatch.setattr(malloc, "release_free", lambda: returns.append(1) or True)
    trimmer = malloc.Trimmer(4)
    assert [trimmer.took() for _ in range(8)] == [False, False, False, True] * 2
    threads = [threading.Thread(target=lambda: [trimmer.took() for _ in range(100)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(returns) == 2 + 8 * 100 // 4  # not one call lost or doubled between the threads
    with pytest.raises(ValueError, match="at least 1"):
        malloc.Trimmer(0)


def test_a_trimmer_with_a_growth_returns_pages_only_once_the_process_grew(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``growth``, a due return waits until the resident memory grew by more than that since the last one
    (the first check sets the floor): buffers the process keeps reusing are not given back and faulted in
    again."""
    from fedmq.broker.wire import malloc

    returns: list[int] = []
    rss = [1000]
    monkeypatch.setattr(malloc, "release_free", lambda: returns.append(1) or True)
    monkeypatch.setattr(malloc, "resident", lambda: rss[0])
    trimmer = malloc.Trimmer(2, growth=100)
    assert [trimmer.took() for _ in range(4)] == [False] * 4 and returns == []  # floor 1000, grown 0
    rss[0] = 1100
    assert [trimmer.took() for _ in range(2)] == [False, False] and returns == []  # 100: not more than growth
    rss[0] = 1101
    assert [trimmer.took() for _ in range(2)] == [False, True] and returns == [1]  # the floor is now 1101
    assert [trimmer.took() for _ in range(2)] == [False, False] and returns == [1]
    rss[0] = None  # not readable: every due call returns, as without a growth
    assert [trimmer.took() for _ in range(2)] == [False, True] and returns == [1, 1]
