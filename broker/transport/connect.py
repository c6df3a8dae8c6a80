"""``connect(url)``: pick the Broker backend by URL scheme (amqp/amqps: RabbitMQ; memory: in-process)."""

from __future__ import annotations

import re
from urllib.parse import unquote

from fedmq.broker.transport.base import Broker
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.options import RABBIT_ONLY, ConnectOptions, taking
from fedmq.broker.transport.urls import check_url

_MEMORY_NAME = re.compile(r"^[A-Za-z0-9_.-]{0,64}$")


@taking(ConnectOptions)
def connect(url: str, options: ConnectOptions, given: frozenset[str]) -> Broker:
    """``connect(url, **keywords)``: one connection to the broker at ``url``; BrokerError (one line) on a bad
    URL, a bad option or an unreachable broker. The keywords are ConnectOptions' (broker.transport.options).

    ``memory://NAME`` or ``memory://USER@NAME`` shares the in-process hub NAME with every connect() of the
    process. ``amqp://USER:PASS@HOST:PORT/VHOST`` (``amqps://`` with ``tls``): RabbitMQ; the user is the
    URL's. ``amqp://USER:PASS@H1:P1,H2:P2,H3:P3/VHOST``: the nodes of one cluster, tried in turn (see
    addresses()).
    """
    scheme = check_url(url)
    if scheme == "memory":
        return _connect_memory(url, options, given)
    from fedmq.broker.transport.rabbitmq import RabbitBroker  # pika is only needed for real brokers

    return RabbitBroker(url, options)


def _connect_memory(url: str, options: ConnectOptions, given: frozenset[str]) -> Broker:
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
    url_user, user = unquote(url_user), options.user
    if user and url_user and user != url_user:
        raise BrokerError(
            f"user {user!r} conflicts with the user {url_user!r} in the broker URL", permanent=True
        )
    unknown = given & set(RABBIT_ONLY)
    if unknown:
        raise BrokerError(
            f"unknown option(s) for the memory broker: {', '.join(sorted(unknown))}", permanent=True
        )
    return MemoryBroker(
        name or "default",
        user=user or url_user or "guest",
        prefetch=options.prefetch,
        chunk_limit=options.chunk_limit,
        max_message_size=options.max_message_size,
        chunk_timeout_s=options.chunk_timeout_s,
    )
