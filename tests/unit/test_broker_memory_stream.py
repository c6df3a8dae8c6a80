"""The in-process stream queue's own semantics: offsets, retention by bytes (RabbitMQ's are tested in
tests/contract/test_model_stream.py)."""

from __future__ import annotations

import threading

import pytest
from load_factor import budget

from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.memory import MemoryBroker


def _stream(name: str, max_bytes: int) -> MemoryBroker:
    b = MemoryBroker(name)
    b._hub.declare("s", {"x-queue-type": "stream", "x-max-length-bytes": max_bytes}, ("k",))
    return b


def _read(b: MemoryBroker, offset, n: int) -> list[tuple[bytes, int]]:
    got, done = [], threading.Event()

    def take(d):
        got.append((d.body, d.headers["x-stream-offset"]))
        b.ack(d)
        if len(got) == n:
            done.set()

    tag = b.consume("s", take, prefetch=2, offset=offset)
    assert done.wait(budget(5))
    b.cancel(tag)
    return got


def test_offsets_and_retention():
    b = _stream("stream-unit", max_bytes=30)
    try:
        for i in range(5):
            b.publish("k", bytes([i]) * 10)  # 10 bytes each: the stream keeps the newest three
        assert [o for _, o in _read(b, "first", 3)] == [2, 3, 4]
        assert _read(b, "last", 1) == [(bytes([4]) * 10, 4)]
        assert [o for _, o in _read(b, 0, 3)] == [
            2,
            3,
            4,
        ]  # an offset that aged out starts at the oldest kept
        assert [o for _, o in _read(b, 3, 2)] == [3, 4]
        assert b.queue_depth("s") == 0  # nothing is "ready": reading never removes
        with pytest.raises(BrokerError, match="stream offset"):
            b.consume("s", lambda d: None, offset=object())
    finally:
        b.close()
