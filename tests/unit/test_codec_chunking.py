"""Chunk split/reassembly: order, duplicates, digests, limits, expiry; fuzzing of decode_chunk."""

from __future__ import annotations

import os
import random

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedmq.broker.transport.reassembly import Reassembler
from fedmq.broker.wire.chunk_frames import (
    DEFAULT_CHUNK_LIMIT,
    FRAME_OVERHEAD,
    Chunk,
    decode_chunk,
    digest,
    encode_chunk,
    is_chunk_frame,
    split,
)
from fedmq.errors import CodecError


def _frames(body: bytes, msg_id: str = "m1", limit: int = 100) -> list[bytes]:
    return [encode_chunk(c) for c in split(body, msg_id, limit)]


def test_split_sizes_and_overhead() -> None:
    body = os.urandom(1050)
    chunks = split(body, "m", 100)
    assert [len(c.data) for c in chunks] == [100] * 10 + [50]
    assert all(c.total == 11 and c.total_size == 1050 and c.digest == digest(body) for c in chunks)
    assert [c.index for c in chunks] == list(range(11))
    assert b"".join(c.data for c in chunks) == body
    assert len(split(body, "m")) == 1 and DEFAULT_CHUNK_LIMIT == 8 * 1024 * 1024
    frames = [encode_chunk(c) for c in chunks]
    assert all(is_chunk_frame(f) for f in frames)
    assert max(len(f) - len(c.data) for f, c in zip(frames, chunks)) <= FRAME_OVERHEAD
    assert not is_chunk_frame(b"FMQ\x01\x00" + bytes(40))


def test_reassembles_out_of_order_with_duplicates() -> None:
    body = os.urandom(2345)
    frames = _frames(body, limit=100)
    order = frames + frames[3:9]
    random.Random(7).shuffle(order)
    r = Reassembler()
    results = []
    for f in order:
        c = decode_chunk(f)
        dup = r.is_duplicate(c)
        out = r.add(c, now=0.0)
        if dup:
            assert out is None
        if out is not None:
            results.append(out)
    assert results == [body]
    assert r.pending_bytes() == 0 and r.pending_messages() == 0
    # a late duplicate of a delivered message is recognised and does not start a new partial message
    late = decode_chunk(frames[0])
    assert r.is_duplicate(late)
    assert r.add(late, now=1.0) is None
    assert r.pending_messages() == 0


def test_last_chunk_first_and_single_and_empty() -> None:
    body = os.urandom(950)
    frames = _frames(body, limit=100)
    r = Reassembler()
    outs = [r.add(decode_chunk(f), now=0.0) for f in reversed(frames)]
    assert outs[:-1] == [None] * 9 and outs[-1] == body
    assert r.add(split(b"", "empty")[0]) == b""
    assert r.add(decode_chunk(encode_chunk(split(b"xyz", "one")[0]))) == b"xyz"


def test_interleaved_messages() -> None:
    a, b = os.urandom(500), os.urandom(730)
    fa, fb = _frames(a, "a"), _frames(b, "b")
    r = Reassembler()
    got = {}
    for f in [x for pair in zip(fa, fb) for x in pair] + fb[len(fa) :]:
        c = decode_chunk(f)
        out = r.add(c, now=0.0)
        if out is not None:
            got[c.msg_id] = out
    assert got == {"a": a, "b": b}
    assert r.pending_bytes() == 0


def test_decode_chunk_rejects_bad_digest_and_malformed() -> None:
    frame = bytearray(_frames(os.urandom(300))[1])
    frame[-5] ^= 0x01  # inside the data
    with pytest.raises(CodecError) as e:
        decode_chunk(bytes(frame))
    assert e.value.reason == "bad-digest"
    for bad in (b"", b"\x00", b"garbage", msgpack.packb([1, 2, 3]), msgpack.packb({"a": 1})):
        with pytest.raises(CodecError) as e:
            decode_chunk(bad)
        assert e.value.reason == "bad-chunk"
    good = msgpack.unpackb(_frames(b"abc")[0])
    good[1] = 2
    with pytest.raises(CodecError) as e:
        decode_chunk(msgpack.packb(good))
    assert e.value.reason == "unknown-version"
    with pytest.raises(CodecError) as e:
        decode_chunk(msgpack.packb(msgpack.ExtType(3, b"x")))
    assert e.value.reason == "bad-chunk"


def test_bad_whole_digest_drops_message() -> None:
    body = os.urandom(300)
    chunks = split(body, "m", 100)
    wrong = bytes(16)
    forged = [Chunk(c.msg_id, c.index, c.total, c.total_size, wrong, c.data) for c in chunks]
    r = Reassembler()
    assert r.add(decode_chunk(encode_chunk(forged[0])), now=0.0) is None
    assert r.add(decode_chunk(encode_chunk(forged[1])), now=0.0) is None
    with pytest.raises(CodecError) as e:
        r.add(decode_chunk(encode_chunk(forged[2])), now=0.0)
    assert e.value.reason == "bad-digest"
    assert r.pending_bytes() == 0
    with pytest.raises(CodecError) as e:  # further chunks of a rejected message are refused too
        r.add(forged[0], now=0.0)
    assert e.value.reason == "message-dropped"


def test_inconsistent_metadata_drops_partial() -> None:
    body = os.urandom(300)
    chunks = split(body, "m", 100)
    r = Reassembler()
    r.add(chunks[0], now=0.0)
    assert r.pending_bytes() == 300
    c = chunks[1]
    with pytest.raises(CodecError) as e:
        r.add(Chunk(c.msg_id, c.index, 4, 400, c.digest, c.data), now=0.0)
    assert e.value.reason == "inconsistent-chunk"
    assert r.pending_bytes() == 0 and r.pending_messages() == 0
    # wrong-sized middle chunk
    r2 = Reassembler()
    r2.add(chunks[0], now=0.0)
    with pytest.raises(CodecError) as e:
        r2.add(Chunk("m", 1, 3, 300, c.digest, c.data[:50]), now=0.0)
    assert e.value.reason == "inconsistent-chunk" and r2.pending_bytes() == 0
    # a first chunk whose size cannot fit the declared layout
    with pytest.raises(CodecError) as e:
        Reassembler().add(Chunk("z", 2, 3, 300, c.digest, b"x" * 7))
    assert e.value.reason == "bad-chunk"


def test_limits() -> None:
    chunks = split(os.urandom(1000), "big", 100)
    r = Reassembler(max_message_size=999)
    with pytest.raises(CodecError) as e:
        r.add(chunks[0], now=0.0)
    assert e.value.reason == "too-large" and r.pending_bytes() == 0
    r = Reassembler(max_pending_bytes=1500)
    r.add(chunks[0], now=0.0)
    other = split(os.urandom(1000), "other", 100)
    with pytest.raises(CodecError) as e:
        r.add(other[0], now=0.0)
    assert e.value.reason == "reassembly-full"
    assert r.pending_bytes() == 1000 and r.pending_messages() == 1


def test_per_sender_limit_and_its_release() -> None:
    """One sender's incomplete messages may reserve at most max_pending_per_sender; completing, failing or
    expiring one frees its share for that sender, and other senders are unaffected."""
    msgs = {m: split(os.urandom(1000), m, 100) for m in ("a", "b", "c", "d")}
    r = Reassembler(max_pending_per_sender=2000, timeout_s=10.0)
    r.add(msgs["a"][0], now=0.0, sender="x")
    r.add(msgs["b"][0], now=0.0, sender="x")
    with pytest.raises(CodecError) as e:
        r.add(msgs["c"][0], now=0.0, sender="x")
    assert e.value.reason == "reassembly-full" and r.pending_messages() == 2
    r.add(msgs["c"][0], now=0.0, sender="y")  # another sender has its own share
    for ch in msgs["a"][1:]:
        out = r.add(ch, now=1.0, sender="x")
    assert out == b"".join(ch.data for ch in msgs["a"])
    r.add(msgs["d"][0], now=1.0, sender="x")  # a's share is free again
    assert r.expire(now=10.5) == ["b", "c"] and r.pending_bytes() == 1000
    assert r._by_sender == {"x": 1000}


def test_expiry_frees_memory() -> None:
    r = Reassembler(timeout_s=10.0)
    a = split(os.urandom(1000), "a", 100)
    b = split(os.urandom(1000), "b", 100)
    r.add(a[0], now=0.0)
    r.add(b[0], now=5.0)
    assert r.pending_bytes() == 2000
    assert r.expire(now=9.0) == []
    assert r.expire(now=12.0) == ["a"]
    assert r.pending_bytes() == 1000
    r.add(b[1], now=14.0)  # activity keeps b alive
    assert r.expire(now=20.0) == []
    # expiry also happens lazily on add
    c = split(b"hello", "c", 100)
    assert r.add(c[0], now=30.0) == b"hello"
    assert r.pending_bytes() == 0 and r.pending_messages() == 0
    # an expired message can be sent again in full
    assert r.add(a[0], now=31.0) is None
    for ch in a[1:]:
        out = r.add(ch, now=31.0)
    assert out == b"".join(ch.data for ch in a)


def test_split_rejects_bad_args() -> None:
    for args in ((b"x", "", 10), (b"x", "m", 0), (b"x", "m" * 200, 10)):
        with pytest.raises(CodecError):
            split(*args)


_VALID = _frames(os.urandom(250), "fz", 100)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_decode_chunk(data: st.DataObject) -> None:
    """Random, truncated and bit-flipped frames: a valid Chunk or CodecError, nothing else."""
    mode = data.draw(st.sampled_from(["random", "truncate", "flip", "repack"]))
    frame = data.draw(st.sampled_from(_VALID))
    if mode == "random":
        blob = data.draw(st.binary(max_size=300))
    elif mode == "truncate":
        blob = frame[: data.draw(st.integers(0, len(frame) - 1))]
    elif mode == "flip":
        b = bytearray(frame)
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(b) - 1))
            b[i] ^= 1 << data.draw(st.integers(0, 7))
        blob = bytes(b)
    else:  # structurally plausible frames with wrong field values
        parts = msgpack.unpackb(frame)
        i = data.draw(st.integers(0, 8))
        parts[i] = data.draw(
            st.one_of(st.integers(-(2**40), 2**40), st.binary(max_size=20), st.text(max_size=5), st.none())
        )
        blob = msgpack.packb(parts)
    try:
        c = decode_chunk(blob)
    except CodecError as e:
        assert e.reason
        return
    assert isinstance(c, Chunk) and 0 <= c.index < c.total and len(c.data) <= c.total_size


def test_frames_are_plain_msgpack_and_decode_without_copying() -> None:
    """encode_chunk writes the bytes msgpack.packb would (wire-compatible);
    decode_chunk views a bytes frame."""
    for size, limit in ((300, 100), (70_000, 66_000), (5, 100), (0, 100)):
        body = os.urandom(size)
        for c in split(body, "\U0001f600" * 128, limit):  # the longest msg_id, 4 UTF-8 bytes per char
            frame = encode_chunk(c)
            parts = msgpack.unpackb(frame)
            assert frame == msgpack.packb(parts, use_bin_type=True)
            assert parts[8] == bytes(c.data) and parts[6] == digest(body)
            d = decode_chunk(frame)
            assert d == c and isinstance(d.data, memoryview) and d.data.readonly and d.data.obj is frame
            assert decode_chunk(bytearray(frame)).data == c.data  # a mutable frame is copied
            assert isinstance(decode_chunk(bytearray(frame)).data, bytes)
            for bad in (frame + b"\x00", frame[:-1]):  # trailing bytes or truncated data: refused
                with pytest.raises(CodecError) as e:
                    decode_chunk(bad)
                assert e.value.reason == "bad-chunk"


def test_reassembled_body_is_bytes_and_independent_of_frames() -> None:
    body = os.urandom(1000)
    frames = [bytearray(f) for f in _frames(body, limit=300)]
    r = Reassembler()
    outs = [r.add(decode_chunk(f), now=0.0) for f in frames]
    for f in frames:  # the frames' buffers are reused by the caller: the body must not change
        f[:] = bytes(len(f))
    assert type(outs[-1]) is bytes and outs[-1] == body
    # corruption of one chunk's data in flight: that chunk is refused, the message never completes wrongly
    r2 = Reassembler()
    good = _frames(body, "c", limit=300)
    bad = bytearray(good[2])
    bad[len(bad) // 2] ^= 0x40
    assert r2.add(decode_chunk(good[0]), now=0.0) is None
    with pytest.raises(CodecError) as e:
        decode_chunk(bytes(bad))
    assert e.value.reason == "bad-digest"
    outs2 = [r2.add(decode_chunk(f), now=0.0) for f in good[1:]]
    assert outs2[-1] == body


def test_chunk_frame_slices_like_the_encoded_frame() -> None:
    """ChunkFrame (header + view of the data, sent by the RabbitMQ backend) reads exactly as encode_chunk."""
    from fedmq.broker.wire.chunk_frames import ChunkFrame

    body = os.urandom(300_000)
    for c in split(body, "m", 131_072):
        f, e = ChunkFrame(c), encode_chunk(c)
        assert len(f) == len(e) and bytes(f) == e
        head = len(f.head)
        for a, z in (
            (0, 131_072),
            (0, 3),
            (head - 1, head + 1),
            (head, head + 7),
            (5, 10**9),
            (len(e), len(e) + 5),
            (9, 2),
        ):
            assert f[a:z] == e[a:z]
        with pytest.raises((TypeError, ValueError)):
            f[::2]
