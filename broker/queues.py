"""The queues a job declares: names from broker.topology, arguments and bindings per its docstrings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from broker import topology as t
from broker.errors import BrokerError

INBOX_ARGS: dict[str, Any] = {"x-queue-type": "quorum", "x-single-active-consumer": True}
LATEST_ARGS: dict[str, Any] = {"x-max-length": 1, "x-overflow": "drop-head"}
CONTROL_ARGS: dict[str, Any] = {}


@dataclass(frozen=True)
class QueueSpec:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    bindings: tuple[str, ...] = ()


def message_chunks(model_bytes: int, chunk_limit: int) -> int:
    """How many messages a model message of up to ``model_bytes`` can take on the wire (1 when unchunked).

    Sizes an agent's latest queue (x-max-length: a max-length-1 queue would keep only the last chunk of a
    chunked model, so it would never arrive) and the aggregator's prefetch. 5 % and one message of slack: a
    trailing chunk of an older model may stay in a latest queue; the reassembler expires it.
    """
    if model_bytes <= chunk_limit:
        return 1
    return math.ceil(model_bytes * 1.05 / chunk_limit) + 1


def job_queues(job: str, agents: list[str] | tuple[str, ...] = (), *, inbox: bool = True,
               latest_max_length: int = 1) -> list[QueueSpec]:
    """Specs of the inbox (if ``inbox``) and each agent's latest/control queues; BrokerError on a bad id."""
    try:
        t.check_name("job id", job)
        for a in agents:
            t.check_name("client id", a)
    except (ValueError, TypeError) as exc:
        raise BrokerError(str(exc)) from None
    specs = []
    if inbox:
        specs.append(QueueSpec(t.q_inbox(job), dict(INBOX_ARGS), tuple(t.inbox_bindings(job))))
    for a in agents:
        latest_args = {**LATEST_ARGS, "x-max-length": latest_max_length}
        specs.append(QueueSpec(t.q_latest(job, a), latest_args, (t.rk_global(job),)))
        specs.append(QueueSpec(t.q_control(job, a), dict(CONTROL_ARGS), (t.rk_control(job),)))
    return specs


def check_publish_args(routing_key: object, body: object) -> None:
    """Reject a bad routing key or body with one clear BrokerError before anything is sent."""
    if not isinstance(routing_key, str) or not routing_key or len(routing_key.encode()) > 255:
        raise BrokerError(f"bad routing key {routing_key!r}: want a non-empty string of at most 255 bytes")
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise BrokerError(f"message body must be bytes, got {type(body).__name__}")
