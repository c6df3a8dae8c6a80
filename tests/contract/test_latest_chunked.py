"""A global model bigger than the chunk limit must reach an agent whole through its max-length latest queue,
whether the agent is consuming when it is published or joins later (then it gets only the newest model)."""

from __future__ import annotations

import os
import threading
import time


from broker import topology as t
from broker.connect import connect
from broker.queues import job_queues, message_chunks

CHUNK = 64 * 1024
MODEL = 5 * CHUNK + 1000  # six chunks


def test_message_chunks_fits_a_chunked_model():
    assert message_chunks(1000, CHUNK) == 1  # unchunked: the newest message only
    assert message_chunks(MODEL, CHUNK) >= 6
    assert job_queues("j", ["a"], latest_max_length=7)[1].arguments["x-max-length"] == 7


def _collect(agent, job):
    got, done = [], threading.Event()

    def handler(d):
        got.append(bytes(d.body))
        agent.ack(d)
        done.set()
    agent.consume(t.q_latest(job, "agent-0"), handler, prefetch=1)
    return got, done


def _aggregator_and_agent(url, job_id):
    """Two connections with a small chunk limit; the agent's latest queue is sized for a MODEL-byte model."""
    memory = url.startswith("memory")
    agg = connect(url, user="fedmq-aggregator" if memory else None, chunk_limit=CHUNK)
    agent = connect(url, user="agent-0" if memory else None, chunk_limit=CHUNK)
    agg.declare_job(job_id, [])
    agent.declare_job(job_id, ["agent-0"], inbox=False, model_bytes=MODEL)
    return agg, agent


def test_chunked_model_reaches_a_consuming_agent(url, job_id):
    agg, agent = _aggregator_and_agent(url, job_id)
    try:
        got, done = _collect(agent, job_id)
        body = os.urandom(MODEL)
        agg.publish(t.rk_global(job_id), body)
        assert done.wait(15), "the chunked model never arrived"
        assert got == [body]
    finally:
        agent.close()
        agg.close()


def test_late_joiner_gets_only_the_newest_chunked_model(url, job_id):
    agg, agent = _aggregator_and_agent(url, job_id)
    try:
        models = [os.urandom(MODEL) for _ in range(3)]
        for m in models:  # published while the agent is not consuming
            agg.publish(t.rk_global(job_id), m)
        got, done = _collect(agent, job_id)
        assert done.wait(15), "the newest model never arrived"
        time.sleep(1.0)  # nothing else (complete) may follow
        assert got == [models[-1]]
    finally:
        agent.close()
        agg.close()
