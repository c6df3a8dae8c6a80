"""``connect(url)``: pick the Broker backend by URL scheme (amqp/amqps: RabbitMQ; memory: in-process)."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

from fedmq.broker.transport.base import CONSUME_TIMEOUT_S, HEARTBEAT_S, PREFETCH, Broker
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.tls import TlsOptions
from fedmq.broker.transport.urls import check_url
from fedmq.broker.wire.chunk_frames import DEFAULT_CHUNK_LIMIT

_MEMORY_NAME = re.compile(r"^[A-Za-z0-9_.-]{0,64}$")


def connect(
    url: str,
    *,
    user: str | None = None,
    prefetch: int = PREFETCH,
    heartbeat: int = HEARTBEAT_S,
    chunk_limit: int = DEFAULT_CHUNK_LIMIT,
    tls: TlsOptions | None = None,
    consume_timeout: float = CONSUME_TIMEOUT_S,
    **kw: Any,
) -> Broker:
    """One connection to the broker at ``url``; BrokerError (one line) on a bad URL or unreachable broker.

    ``memory://NAME`` or ``memory://USER@NAME`` shares the in-process hub NAME with every connect() of the
    process. ``amqp://USER:PASS@HOST:PORT/VHOST`` (``amqps://`` with ``tls``): RabbitMQ; the user is the
    URL's. ``amqp://USER:PASS@H1:P1,H2:P2,H3:P3/VHOST``: the nodes of one cluster, tried in turn (see
    addresses()). ``heartbeat`` and ``consume_timeout`` (how long RabbitMQ may take to confirm a subscription
    before the queue counts as broken) only apply to RabbitMQ. Extra keywords go to the backend (e.g.
    ``connect_timeout``, ``publish_timeout``, ``max_message_size``).
    """
    scheme = check_url(url)
    if not isinstance(prefetch, int) or prefetch < 1:
        raise BrokerError(f"prefetch must be a positive integer, got {prefetch!r}", permanent=True)
    if not isinstance(chunk_limit, int) or chunk_limit < 1024:
        raise BrokerError(
            f"chunk limit must be an integer of at least 1024 bytes, got {chunk_limit!r}", permanent=True
        )
    if not isinstance(heartbeat, int) or heartbeat < 0:
        raise BrokerError(
            f"heartbeat must be a non-negative integer of seconds, got {heartbeat!r}", permanent=True
        )
    if (
        isinstance(consume_timeout, bool)
        or not isinstance(consume_timeout, (int, float))
        or not consume_timeout > 0
    ):
        raise BrokerError(
            f"consume timeout must be a positive number of seconds, got {consume_timeout!r}", permanent=True
        )
    if scheme == "memory":
        return _connect_memory(url, user, prefetch, chunk_limit, kw)
    from fedmq.broker.transport.rabbitmq import RabbitBroker  # pika is only needed for real brokers

    return RabbitBroker(
        url,
        user=user,
        prefetch=prefetch,
        heartbeat=heartbeat,
        chunk_limit=chunk_limit,
        tls=tls,
        consume_timeout=consume_timeout,
        **kw,
    )


def _connect_memory(
    url: str, user: str | None, prefetch: int, chunk_limit: int, kw: dict[str, Any]
) -> Broker:
    from fedmq.broker.transport.memory import MemoryBroker

    rest = url.split("://", 1)[1]
    if "/" in rest or "?" in rest:
        raise BrokerError(
            f"bad memory broker URL {url!r}: want memory://NAME or memory://USER@NAME", permanent=True
        )
    url_user, _, name = rest.rpartition("@")
    if not _MEMORY_NAME.match(name):
        raise BrokerError(
            f"bad memory broker name {name!r}: use letters, digits, '.', '-' or '_'", permanent=True
        )
    url_user = unquote(url_user)
    if user and url_user and user != url_user:
        raise BrokerError(
            f"user {user!r} conflicts with the user {url_user!r} in the broker URL", permanent=True
        )
    unknown = set(kw) - {"max_message_size", "chunk_timeout_s"}
    if unknown:
        raise BrokerError(
            f"unknown option(s) for the memory broker: {', '.join(sorted(unknown))}", permanent=True
        )
    return MemoryBroker(
        name or "default", user=user or url_user or "guest", prefetch=prefetch, chunk_limit=chunk_limit, **kw
    )
