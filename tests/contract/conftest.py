"""Fixtures of the contract tests that run against both backends."""

from __future__ import annotations

import uuid

import pika
import pytest

from fedmq.broker.transport.queues import job_queues


@pytest.fixture(params=["memory", "rabbitmq"])
def url(request, job_id):
    """A broker URL of each backend; on RabbitMQ the job's queues
    (agent ``agent-0``) are deleted afterwards."""
    if request.param == "memory":
        yield f"memory://contract-{uuid.uuid4().hex[:8]}"
        return
    rabbit = request.getfixturevalue("rabbit_url")
    yield rabbit
    conn = pika.BlockingConnection(pika.URLParameters(rabbit))
    ch = conn.channel()
    for spec in job_queues(job_id, ["agent-0"], model_bytes=1):
        ch.queue_delete(spec.name)
    conn.close()
