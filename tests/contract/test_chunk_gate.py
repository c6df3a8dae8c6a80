"""ChunkGate: how raw chunk deliveries become whole deliveries, and which raw tags get acked when."""

from __future__ import annotations

import os

from fedmq.broker.transport.base import Delivery
from fedmq.broker.transport.reassembly import ChunkGate
from fedmq.broker.wire.chunk_frames import CHUNK_HEADER, chunk_messages

LIMIT = 1024


def raw(body: bytes, tag: int, chunk: bool = True) -> Delivery:
    return Delivery(
        body=body,
        routing_key="rk",
        queue="q",
        message_id="m",
        headers={CHUNK_HEADER: 1} if chunk else {},
        tag=tag,
    )


def test_chunks_are_held_until_the_message_is_whole_then_settled_together():
    body = os.urandom(5 * LIMIT)
    frames = chunk_messages(body, "m1", LIMIT)
    assert frames is not None and len(frames) == 5
    gate = ChunkGate(window=64)
    outs = [gate.feed(raw(f, tag)) for tag, f in enumerate(frames)]
    assert all(o.deliver is None and not o.ack and not o.reject for o in outs[:-1])
    whole = outs[-1].deliver
    assert (
        whole is not None
        and whole.body == body
        and whole.message_id == "m1"
        and CHUNK_HEADER not in whole.headers
    )
    assert gate.settle(whole.tag) == [0, 1, 2, 3, 4]
    assert gate.settle(whole.tag) == []  # settling twice yields nothing the second time
    assert chunk_messages(b"x" * LIMIT, "small", LIMIT) is None  # fits: sent as one plain message


def test_duplicate_chunk_is_acked_and_bad_chunk_rejected():
    frames = chunk_messages(os.urandom(3 * LIMIT), "m2", LIMIT)
    gate = ChunkGate(window=64)
    assert gate.feed(raw(frames[0], 1)).ack == []
    assert gate.feed(raw(frames[0], 2)).ack == [2]  # same chunk again: acked and dropped
    bad = gate.feed(raw(b"\x99not a frame", 3))
    assert bad.reject == [3] and bad.reason == "bad-chunk" and gate.rejected == 1
    corrupt = bytearray(frames[1])
    corrupt[-1] ^= 0xFF
    assert gate.feed(raw(bytes(corrupt), 4)).reason == "bad-digest"
    plain = gate.feed(raw(b"plain", 5, chunk=False)).deliver
    assert plain is not None and plain.body == b"plain" and gate.settle(plain.tag) == [5]


def test_window_full_of_held_chunks_acks_them_early():
    body = os.urandom(6 * LIMIT)
    frames = chunk_messages(body, "m3", LIMIT)
    gate = ChunkGate(window=4)
    outs = [gate.feed(raw(f, tag)) for tag, f in enumerate(frames)]
    assert outs[3].ack == [0, 1, 2, 3] and gate.early_acked == 4  # would deadlock otherwise
    whole = outs[-1].deliver
    assert whole is not None and whole.body == body
    assert gate.settle(whole.tag) == [4, 5]


def test_reset_after_a_lost_connection_voids_old_tags_but_keeps_data():
    body = os.urandom(3 * LIMIT)
    frames = chunk_messages(body, "m4", LIMIT)
    gate = ChunkGate(window=64)
    gate.feed(raw(frames[0], 1))
    gate.feed(raw(frames[1], 2))
    gate.reset()  # the broker requeued tags 1 and 2; they come back with new tags
    assert gate.feed(raw(frames[0], 11)).ack == [11]  # already buffered: duplicate
    assert gate.feed(raw(frames[1], 12)).ack == [12]
    whole = gate.feed(raw(frames[2], 13)).deliver
    assert whole is not None and whole.body == body and gate.settle(whole.tag) == [13]
    old = gate.feed(raw(b"p", 14, chunk=False)).deliver
    gate.reset()
    assert gate.settle(old.tag) == []  # a delivery from the previous connection cannot be acked
