"""The job's model stream, on both backends: each global model is published once and read by id, from an
offset, by as many agents as need it; reading removes nothing; a chunked model arrives whole."""

from __future__ import annotations

import os
import time

import pytest

from fedmq.broker.transport import topology as t
from fedmq.broker.transport.connect import connect
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.queues import STREAM_VERSIONS, job_queues, message_chunks, model_stream_args

CHUNK = 64 * 1024
MODEL = 5 * CHUNK + 1000  # six chunks


def test_stream_and_prefetch_sizes():
    assert message_chunks(1000, CHUNK) == 1
    assert message_chunks(MODEL, CHUNK) >= 6
    args = model_stream_args(MODEL)
    assert args["x-queue-type"] == "stream" and args["x-max-length-bytes"] == STREAM_VERSIONS * (1 << 20)
    names = [s.name for s in job_queues("j", ["a"], model_bytes=MODEL)]
    assert t.q_models("j") in names and t.q_latest("j", "a") in names
    assert t.q_models("j") not in [
        s.name for s in job_queues("j", ["a"])
    ]  # only the aggregator (it knows the size)


def _pair(url, job_id):
    memory = url.startswith("memory")
    agg = connect(url, user="fedmq-aggregator" if memory else None, chunk_limit=CHUNK)
    readers = [connect(url, user=f"agent-{i}" if memory else None, chunk_limit=CHUNK) for i in range(2)]
    agg.declare_job(job_id, ["agent-0"], model_bytes=MODEL)
    return agg, readers


def _close(*brokers):
    for b in brokers:
        b.close()


def test_a_chunked_model_is_read_whole_by_id_by_every_reader(url, job_id):
    agg, readers = _pair(url, job_id)
    try:
        since = time.time()
        models = {}
        for i in range(3):
            body = os.urandom(MODEL)
            msg_id = f"model-{i}-{job_id}"
            agg.publish(t.rk_model(job_id), body, message_id=msg_id)
            models[msg_id] = body
        wanted = f"model-1-{job_id}"
        for reader in readers:  # both read the same message: consuming a stream removes nothing
            d = reader.fetch(t.q_models(job_id), wanted, offset=since, timeout=15)
            assert d.message_id == wanted and bytes(d.body) == models[wanted]
        first = readers[0].fetch(t.q_models(job_id), f"model-0-{job_id}", offset="first", timeout=15)
        assert bytes(first.body) == models[f"model-0-{job_id}"]
    finally:
        _close(agg, *readers)


def test_a_model_a_reader_cannot_see_is_one_clear_error(url, job_id):
    """Not in the stream at all, or published before the reader's start: BrokerError,
    and the reader still works."""
    agg, readers = _pair(url, job_id)
    try:
        agg.publish(t.rk_model(job_id), b"m", message_id="present")
        for missing, offset in (("absent", "first"), ("present", "next")):
            with pytest.raises(BrokerError, match="not found"):
                readers[0].fetch(t.q_models(job_id), missing, offset=offset, timeout=2)
        d = readers[0].fetch(t.q_models(job_id), "present", offset="first", timeout=10)
        assert bytes(d.body) == b"m"
    finally:
        _close(agg, *readers)
