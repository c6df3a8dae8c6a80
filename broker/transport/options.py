"""ConnectOptions: what a connection takes besides its URL, each default defined once and every value
checked when the options are built; connect() takes them as keywords (see ``taking``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Concatenate, ParamSpec

from fedmq.broker.transport.base import CONSUME_TIMEOUT_S, HEARTBEAT_S, PREFETCH, Broker
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.tls import TlsOptions
from fedmq.broker.wire.chunk_frames import DEFAULT_CHUNK_LIMIT

EXCHANGE_CHECK_S = 10.0  # how often a broker checks that its jobs' exchanges exist

P = ParamSpec("P")


@dataclass(frozen=True, kw_only=True)
class ConnectOptions:
    """A connection's options; BrokerError (permanent, one line) on a bad prefetch, chunk limit, heartbeat or
    consume timeout. ``user`` overrides the URL's (memory only; they must agree). The in-process backend takes
    ``user``, ``prefetch``, ``chunk_limit``, ``max_message_size`` and ``chunk_timeout_s`` and ignores
    ``heartbeat``, ``tls`` and ``consume_timeout``; the rest are RabbitMQ's alone (RABBIT_ONLY)."""

    user: str | None = None
    prefetch: int = PREFETCH
    heartbeat: int = HEARTBEAT_S
    chunk_limit: int = DEFAULT_CHUNK_LIMIT
    tls: TlsOptions | None = None
    connect_timeout: float = 5.0
    publish_timeout: float = 300.0
    max_backoff: float = 5.0
    max_message_size: int = 4 * 1024**3
    chunk_timeout_s: float = 600.0
    # how long RabbitMQ may take to confirm a subscription before the queue counts as broken
    consume_timeout: float = CONSUME_TIMEOUT_S
    confirm_stall_s: float = 15.0
    exchange_check_s: float = EXCHANGE_CHECK_S
    presence_lane: bool = True  # presence on a second connection (see broker.transport.rabbitmq)

    def __post_init__(self) -> None:
        prefetch, chunk_limit, heartbeat, timeout = (
            self.prefetch,
            self.chunk_limit,
            self.heartbeat,
            self.consume_timeout,
        )
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
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise BrokerError(
                f"consume timeout must be a positive number of seconds, got {timeout!r}", permanent=True
            )


# the options only a RabbitMQ connection has: the in-process backend refuses them
RABBIT_ONLY = (
    "connect_timeout",
    "publish_timeout",
    "max_backoff",
    "confirm_stall_s",
    "exchange_check_s",
    "presence_lane",
)


def taking(
    options: Callable[P, ConnectOptions],
) -> Callable[
    [Callable[[str, ConnectOptions, frozenset[str]], Broker]], Callable[Concatenate[str, P], Broker]
]:
    """Decorate ``f(url, options, given)`` to be called as ``f(url, **keywords)``: the keywords are those of
    ``options`` (ConnectOptions), typed as such, and ``given`` names the ones the caller passed."""

    def wrap(
        f: Callable[[str, ConnectOptions, frozenset[str]], Broker],
    ) -> Callable[Concatenate[str, P], Broker]:
        @functools.wraps(f)
        def call(url: str, *args: P.args, **kw: P.kwargs) -> Broker:
            return f(url, options(*args, **kw), frozenset(kw))

        return call

    return wrap
