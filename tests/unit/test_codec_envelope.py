"""Envelope pack/unpack: round trips, version/kind/digest checks, bombs, and fuzzing of unpack."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zstandard as zstd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedmq.broker.wire.blobs import digest
from fedmq.broker.wire.encodings import EncodingSpec, decode_state, encode_state
from fedmq.broker.wire.envelope import (
    FLAG_ZSTD,
    HEADER_SIZE,
    SCHEMA_VERSION,
    Envelope,
    Kind,
    Limits,
    pack,
    unpack,
)
from fedmq.errors import CodecError
from fedmq.manifest import Manifest

STATE = {
    "w": (np.random.default_rng(0).standard_normal((64, 48)) * 0.05).astype(np.float32),
    "b": np.ones(48, np.float32),
}
MAN = Manifest.from_arrays(STATE)


def _frame(body: bytes, flags: int = 0, version: int = SCHEMA_VERSION) -> bytes:
    return b"FMQ" + bytes((version, flags)) + digest(body) + body


def _body(**over) -> list:
    fields = {
        "kind": "report",
        "job": "j1",
        "round": 1,
        "client": "c1",
        "mv": 0,
        "id": "abc",
        "at": 1.0,
        "payload": {"loss": 0.5},
    }
    fields.update(over)
    return list(fields.values())


def _reason(data: bytes, **kw) -> str:
    with pytest.raises(CodecError) as e:
        unpack(data, **kw)
    return e.value.reason


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("level", [0, 3])
def test_roundtrip_every_kind(kind: Kind, level: int) -> None:
    env = Envelope(
        kind,
        "job-1",
        7,
        "client_3",
        6,
        {"n_samples": 10, "loss": 1.5, "ok": True, "blob": b"\x00" * 500, "xs": [1, 2]},
    )
    out = unpack(pack(env, level=level))
    assert out == env and isinstance(out.kind, Kind)


def test_tensor_payload_end_to_end() -> None:
    env = Envelope(
        Kind.UPDATE,
        "j",
        2,
        "c",
        1,
        {"n_samples": 3, "tensors": encode_state(STATE, EncodingSpec.parse("bf16"))},
    )
    out = decode_state(unpack(pack(env)).payload["tensors"], MAN)
    assert np.all(np.abs(out["w"] - STATE["w"]) <= np.abs(STATE["w"]) * 2.0**-8)


def test_small_bodies_compressed_large_not() -> None:
    small = pack(Envelope(Kind.ANNOUNCE, "j", 0, "", 0, {"text": "x" * 5000}))
    assert small[4] == FLAG_ZSTD and len(small) < 500
    big = pack(Envelope(Kind.UPDATE, "j", 0, "c", 0, {"blob": bytes(2 << 20)}))
    assert big[4] == 0


def test_unknown_version_and_kind() -> None:
    good = pack(Envelope(Kind.REPORT, "j", 1, "c", 0, {}))
    assert _reason(good[:3] + bytes((2,)) + good[4:]) == "unknown-version"
    assert _reason(_frame(msgpack.packb(_body(kind="bogus")))) == "unknown-kind"
    with pytest.raises(CodecError) as e:
        pack(Envelope(Kind.REPORT, "j", 1, "c", 0, {}, version=9))
    assert e.value.reason == "unknown-version"


def test_digest_mismatch() -> None:
    good = bytearray(pack(Envelope(Kind.REPORT, "j", 1, "c", 0, {"loss": 2.0}, sent_at=5.0), level=0))
    good[-1] ^= 0x10
    assert _reason(bytes(good)) == "bad-digest"


def test_bombs() -> None:
    huge = zstd.ZstdCompressor(level=19).compress(bytes(64 << 20))  # ~2 KiB declaring 64 MiB
    assert len(huge) < 10_000
    assert _reason(_frame(huge, FLAG_ZSTD), limits=Limits(max_decompressed_bytes=1 << 20)) == "bomb"
    assert (
        _reason(_frame(huge, FLAG_ZSTD)) == "bomb"
    )  # by default: pack never zstd's a body over COMPRESS_MAX
    unknown = zstd.ZstdCompressor(write_content_size=False).compress(msgpack.packb(_body()))
    assert _reason(_frame(unknown, FLAG_ZSTD)) == "bomb"
    # a msgpack map claiming 2^31 entries, and an array claiming 2^32-1
    assert _reason(_frame(b"\x98" + msgpack.packb(_body())[1:-1] + b"\xdf\x80\x00\x00\x00")) == "malformed"
    assert _reason(_frame(b"\xdd\xff\xff\xff\xff")) == "malformed"
    assert _reason(b"x" * 100, limits=Limits(max_message_bytes=50)) == "too-large"


def test_rejects_ext_types_and_bad_fields() -> None:
    assert _reason(_frame(msgpack.packb(_body(payload={"t": msgpack.ExtType(1, b"x")})))) == "malformed"
    assert _reason(_frame(msgpack.packb(_body(payload={"t": msgpack.Timestamp(1, 0)})))) == "malformed"
    bad_fields = [
        {"job": "a.b"},
        {"job": ""},
        {"client": "x y"},
        {"round": "1"},
        {"round": True},
        {"mv": -5},
        {"id": ""},
        {"at": "now"},
        {"payload": [1]},
        {"payload": {1: 2}},
    ]
    for over in bad_fields:
        with pytest.raises(CodecError) as e:
            unpack(_frame(msgpack.packb(_body(**over), use_bin_type=True)))
        assert e.value.reason in {"bad-envelope", "malformed"}, over
    assert _reason(_frame(msgpack.packb(_body()[:7]))) == "malformed"
    assert _reason(_frame(msgpack.packb(_body()) + b"\x00")) == "malformed"  # trailing bytes
    for junk in (b"", b"FMQ", b"XYZ" + bytes(30)):
        assert _reason(junk) == "malformed"
    assert _reason(_frame(b"", flags=0x80)) == "malformed"


def test_pack_rejects_bad_envelopes() -> None:
    for env in (
        Envelope(Kind.REPORT, "j", 1, "c", 0, {"x": object()}),
        Envelope(Kind.REPORT, "bad job", 1, "c", 0, {}),
        Envelope("nope", "j", 1, "c", 0, {}),  # type: ignore[arg-type]
    ):
        with pytest.raises(CodecError):
            pack(env)


VALID = [
    pack(
        Envelope(
            Kind.UPDATE,
            "j",
            3,
            "c9",
            2,
            {"n_samples": 4, "tensors": encode_state(STATE, EncodingSpec.parse("int8"))},
        ),
        level=0,
    ),
    pack(Envelope(Kind.REPORT, "j", 3, "c9", 2, {"loss": 0.25, "n": 4}), level=3),
]


def _check(env: Envelope) -> None:
    assert isinstance(env, Envelope) and isinstance(env.kind, Kind) and isinstance(env.payload, dict)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_unpack(data: st.DataObject) -> None:
    """Random, truncated and bit-flipped messages (with and without a recomputed digest, so the parser
    behind the digest check is exercised too): a valid Envelope or CodecError, nothing else."""
    msg = data.draw(st.sampled_from(VALID))
    mode = data.draw(st.sampled_from(["random", "truncate", "flip", "flip-redigest", "truncate-redigest"]))
    if mode == "random":
        blob = data.draw(st.binary(max_size=300))
        if data.draw(st.booleans()):
            blob = _frame(blob, data.draw(st.sampled_from([0, FLAG_ZSTD])))
    elif mode.startswith("truncate"):
        cut = data.draw(st.integers(0, len(msg) - 1))
        blob = msg[:cut] if mode == "truncate" or cut < HEADER_SIZE else _frame(msg[HEADER_SIZE:cut], msg[4])
    else:
        b = bytearray(msg)
        lo = HEADER_SIZE if mode == "flip-redigest" else 0
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(lo, len(b) - 1))
            b[i] ^= 1 << data.draw(st.integers(0, 7))
        blob = bytes(b) if mode == "flip" else _frame(bytes(b[HEADER_SIZE:]), b[4])
    try:
        env = unpack(blob)
    except CodecError as e:
        assert e.reason
        return
    _check(env)
    if env.kind is Kind.UPDATE and isinstance(env.payload.get("tensors"), dict):
        try:
            out = decode_state(env.payload["tensors"], MAN)
        except CodecError:
            return
        assert all(out[k].shape == STATE[k].shape and np.isfinite(out[k]).all() for k in out)


def test_large_payload_body_is_exactly_msgpack() -> None:
    """Big binary leaves are written by reference: the body must still be byte-identical to msgpack.packb."""
    import msgpack
    import numpy as np

    from fedmq.broker.wire.envelope import HEADER_SIZE

    big = np.arange(50_000, dtype=np.float32)
    payload = {
        "n_samples": 3,
        "tensors": {
            "t": [
                {"p": [[0, big.nbytes, memoryview(big)], [1, 5, b"x" * 70_000]]},
                {"q": (bytearray(b"y" * 65_536), b"small", 1.5, None)},
            ]
        },
        "deep": [[[[[[[[[[b"z" * 80_000]]]]]]]]]],
        "text": "é" * 10,
    }
    env = Envelope(Kind.UPDATE, "j", 1, "c", 0, payload, msg_id="m", sent_at=2.0)
    wire = pack(env, level=0)
    want = msgpack.packb(["update", "j", 1, "c", 0, "m", 2.0, payload], use_bin_type=True)
    assert wire[HEADER_SIZE:] == want and wire[5:HEADER_SIZE] == digest(want)
    out = unpack(wire)
    assert out.payload["tensors"]["t"][0]["p"][0][2] == big.tobytes()
    assert out.payload["tensors"]["t"][1]["q"][0] == b"y" * 65_536
