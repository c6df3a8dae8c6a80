"""The queues a job declares: names from broker.transport.topology, arguments and bindings per its docstrings.

Every queue is a quorum queue (or, for models, a stream): on a RabbitMQ cluster each is replicated, so the
loss of a minority of nodes loses no queue and no confirmed message; a client that reconnects to another node
finds its queues there. On a single node they behave like durable classic queues.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fedmq.broker.transport import topology as t
from fedmq.broker.transport.errors import BrokerError

QUORUM: dict[str, Any] = {"x-queue-type": "quorum"}
INBOX_ARGS: dict[str, Any] = {**QUORUM, "x-single-active-consumer": True}
DELIVERY_LIMIT = 5  # deliveries of one inbox message beyond the first before RabbitMQ dead-letters it
DEAD_ARGS: dict[str, Any] = {
    **QUORUM,
    "x-max-length": 10_000,
    "x-max-length-bytes": 1 << 30,
    "x-overflow": "drop-head",
}


def inbox_args(job: str) -> dict[str, Any]:
    """The inbox's arguments: a message returned more than DELIVERY_LIMIT times (its consumer died holding it,
    e.g. killed by it) or rejected goes to the job's dead-letter queue instead of coming back forever."""
    return {
        **INBOX_ARGS,
        "x-delivery-limit": DELIVERY_LIMIT,
        "x-dead-letter-exchange": t.exchange(job),
        "x-dead-letter-routing-key": t.rk_dead(job),
    }


LATEST_ARGS: dict[str, Any] = {**QUORUM, "x-max-length": 1, "x-overflow": "drop-head"}
CONTROL_ARGS: dict[str, Any] = dict(QUORUM)
STREAM_VERSIONS = 4  # model messages (a version can have a full and a delta/partial form) the stream retains
MIN_SEGMENT = 1 << 20


def model_stream_args(model_bytes: int) -> dict[str, Any]:
    """Arguments of the job's model stream: retention of about STREAM_VERSIONS model messages.

    RabbitMQ deletes a stream's oldest *segment* once the stream is over ``x-max-length-bytes``, so the
    segment size is one model message: retention then keeps between STREAM_VERSIONS - 1 and STREAM_VERSIONS of
    them. A selected agent reads its version within the round it was announced for, long before it ages out.
    """
    segment = max(int(model_bytes), MIN_SEGMENT)
    return {
        "x-queue-type": "stream",
        "x-max-length-bytes": STREAM_VERSIONS * segment,
        "x-stream-max-segment-size-bytes": segment,
    }


@dataclass(frozen=True)
class QueueSpec:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    bindings: tuple[str, ...] = ()


def message_chunks(model_bytes: int, chunk_limit: int) -> int:
    """How many messages a model message of up to ``model_bytes`` can take on the wire (1 when unchunked).

    Sizes the aggregator's prefetch (every chunk of every selected update can be in flight) and a model
    reader's. 5 % and one message of slack.
    """
    if model_bytes <= chunk_limit:
        return 1
    return math.ceil(model_bytes * 1.05 / chunk_limit) + 1


def edge_queue(job: str, edge: int) -> QueueSpec:
    """Edge aggregator ``edge``'s queue (two-tier aggregation; the root and the edge declare it): the inbox's
    arguments, so one edge of a number is active and a second waits as its hot standby, and a message that
    kills its consumer again and again is dead-lettered."""
    return QueueSpec(t.q_edge(job, edge), inbox_args(job), tuple(t.edge_bindings(job, edge)))


def job_queues(
    job: str,
    agents: list[str] | tuple[str, ...] = (),
    *,
    inbox: bool = True,
    model_bytes: int = 0,
    edges: tuple[int, ...] = (),
) -> list[QueueSpec]:
    """Specs of the inbox and, given ``model_bytes`` (which sizes its retention), the model stream (if
    ``inbox``: the aggregator's side) and each agent's latest/control queues; BrokerError on a bad id."""
    try:
        t.check_name("job id", job)
        for a in agents:
            t.check_name("client id", a)
    except (ValueError, TypeError) as exc:
        raise BrokerError(str(exc)) from None
    specs = []
    if inbox:
        specs.append(
            QueueSpec(t.q_dead(job), dict(DEAD_ARGS), (t.rk_dead(job),))
        )  # before the inbox that feeds it
        specs.append(QueueSpec(t.q_inbox(job), inbox_args(job), tuple(t.inbox_bindings(job))))
        if model_bytes > 0:  # the aggregator's declaration: it knows the model's size
            specs.append(QueueSpec(t.q_models(job), model_stream_args(model_bytes), (t.rk_model(job),)))
    for a in agents:
        specs.append(
            QueueSpec(t.q_latest(job, a), dict(LATEST_ARGS), (t.rk_global(job), t.rk_announce(job, a)))
        )
        specs.append(
            QueueSpec(t.q_control(job, a), dict(CONTROL_ARGS), (t.rk_control(job), t.rk_grant(job, a)))
        )
    specs.extend(edge_queue(job, e) for e in edges)
    return specs


def check_publish_args(routing_key: object, body: object) -> None:
    """Reject a bad routing key or body with one clear BrokerError before anything is sent."""
    if not isinstance(routing_key, str) or not routing_key or len(routing_key.encode()) > 255:
        raise BrokerError(f"bad routing key {routing_key!r}: want a non-empty string of at most 255 bytes")
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise BrokerError(f"message body must be bytes, got {type(body).__name__}")
