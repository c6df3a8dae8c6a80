"""A chunked message whose sender died mid-upload is dropped after the chunk timeout on both backends: its
held chunks are rejected (nothing stays unacked, so nothing is redelivered later),
and so is a straggler chunk."""

from __future__ import annotations

import os
import time

from load_factor import budget

from fedmq.broker.transport import topology as t
from fedmq.broker.transport.connect import connect
from fedmq.broker.wire.chunk_frames import CHUNK_HEADER, encode_chunk, split


def test_partial_chunked_message_expires_and_is_not_redelivered(url, job_id):
    memory = url.startswith("memory")
    sender = connect(url, user="fedmq-aggregator" if memory else None)
    receiver = connect(url, user="agent-0" if memory else None, chunk_timeout_s=1.0)
    got = []
    try:
        sender.declare_job(job_id, [])
        receiver.declare_job(job_id, ["agent-0"], inbox=False)
        queue = t.q_control(job_id, "agent-0")
        receiver.consume(queue, lambda d: (got.append(d.body), receiver.ack(d)), prefetch=8)
        chunks = split(os.urandom(3 * 4096), "partial-1", 4096)
        assert len(chunks) == 3
        for c in chunks[:2]:  # the sender dies before the last chunk
            sender.publish(t.rk_control(job_id), encode_chunk(c), headers={CHUNK_HEADER: 1})
        time.sleep(3.5)  # > timeout + the dispatcher's expiry period
        sender.publish(t.rk_control(job_id), encode_chunk(chunks[2]), headers={CHUNK_HEADER: 1})  # too late
        sender.publish(t.rk_control(job_id), b"whole")  # the queue keeps working
        deadline = time.time() + budget(10)
        while not got and time.time() < deadline:
            time.sleep(0.1)
        assert got == [b"whole"]
        time.sleep(3.0)  # the straggler started a new partial message: it expires too
    finally:
        receiver.close()
    # nothing of the partial message was left unacked: closing the consumer requeues nothing
    time.sleep(0.5)
    assert sender.queue_depth(t.q_control(job_id, "agent-0")) == 0
    sender.close()
