"""Reconnection of the RabbitMQ backend: which node to try, how long to wait between tries, and why it failed.

The I/O thread (broker.transport.rabbit_io) connects through :meth:`Reconnection.connect` and, after any
connection loss (including 320 CONNECTION_FORCED on a broker restart), calls :meth:`Reconnection.retry`:
attempts back off exponentially (0.2 s doubling, capped at ``max_backoff``, with jitter) until one connects
and what lived on the old connection (declared topology, consumers) is restored. A URL with several addresses
(the nodes of one cluster) is tried address by address, starting after the node just lost.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable

import pika
import pika.exceptions as pe
import structlog

from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.tls import TlsOptions, ssl_options
from fedmq.broker.transport.urls import addresses, redact

log = structlog.get_logger(__name__)

CONNECTION_ERRORS = (
    pe.AMQPConnectionError,
    pe.ConnectionClosed,
    pe.StreamLostError,
    pe.ConnectionWrongStateError,
    OSError,
)
FIRST_DELAY = 0.2


def refused(exc: BaseException | None) -> bool:
    """Did the broker refuse the credentials or the virtual host
    (pika wraps the cause in connector errors)?"""
    while exc is not None:
        if isinstance(
            exc, (pe.ProbableAuthenticationError, pe.AuthenticationError, pe.ProbableAccessDeniedError)
        ):
            return True
        inner = getattr(exc, "exception", None)
        if inner is None and isinstance(exc, pe.AMQPConnectionError) and exc.args:
            inner = exc.args[0]
        exc = inner if isinstance(inner, BaseException) else None
    return False


def describe(exc: BaseException, node: pika.URLParameters, user: str) -> str:
    """Why connecting ``user`` to ``node`` failed, in words for a person, not exception class names."""
    if isinstance(exc, (pe.ProbableAuthenticationError, pe.AuthenticationError)):
        return f"authentication refused for user {user!r}"
    if isinstance(exc, pe.ProbableAccessDeniedError):
        return f"access to virtual host {node.virtual_host!r} refused for user {user!r}"
    inner = getattr(exc, "exception", None)  # pika's connector-phase errors wrap the cause here
    if isinstance(inner, BaseException):
        return describe(inner, node, user)
    if isinstance(exc, pe.AMQPConnectionError) and exc.args:
        inner = exc.args[0]
        if isinstance(inner, BaseException):
            return describe(inner, node, user)
        return str(inner) or "connection failed"
    where = f"{node.host}:{node.port}"
    if isinstance(exc, socket.gaierror):
        return f"unknown host {node.host!r}"
    if isinstance(exc, TimeoutError) or type(exc).__name__ == "AMQPConnectorStackTimeout":
        return f"no answer from {where} (timed out)"
    if isinstance(exc, OSError) and exc.strerror:
        return (
            f"{exc.strerror.lower()} by {where}"
            if isinstance(exc, ConnectionRefusedError)
            else f"{exc.strerror.lower()} ({where})"
        )
    return str(exc) or type(exc).__name__


def node_parameters(
    url: str, tls: TlsOptions | None, user: str | None, heartbeat: int, connect_timeout: float
) -> list[pika.URLParameters]:
    """pika's connection parameters for each node of the broker URL (see urls.addresses); BrokerError
    (permanent) on a malformed URL, a user that conflicts with the URL's, or TLS options on a plain URL."""
    return [_parameters(a, tls, user, heartbeat, connect_timeout) for a in addresses(url)]


def _parameters(
    url: str, tls: TlsOptions | None, user: str | None, heartbeat: int, connect_timeout: float
) -> pika.URLParameters:
    try:
        params = pika.URLParameters(url)
    except Exception as exc:  # pika raises assorted errors on malformed URLs
        raise BrokerError(f"bad broker URL {redact(url)!r}: {exc}", permanent=True) from None
    url_user = params.credentials.username
    if user and user != url_user and "@" in url:
        raise BrokerError(
            f"user {user!r} conflicts with the user {url_user!r} in the broker URL", permanent=True
        )
    if url.lower().startswith("amqps://"):
        params.ssl_options = ssl_options(tls, params.host)
    elif tls is not None:
        raise BrokerError("TLS options given for a plain amqp:// URL: use amqps://", permanent=True)
    params.heartbeat = heartbeat
    params.socket_timeout = connect_timeout
    params.stack_timeout = connect_timeout * 2
    params.blocked_connection_timeout = None
    params.connection_attempts = 1
    return params


class Reconnection:
    """The nodes of the broker URL, the one to try first, and the backoff between attempts."""

    def __init__(self, nodes: list[pika.URLParameters], max_backoff: float) -> None:
        self.nodes = nodes
        self.max_backoff = max_backoff
        self.node = nodes[0]  # the node tried last: the one connected to, once connect() returned
        self._at = 0  # the node tried first: the one last connected to, the next one after losing it

    def connect(self) -> pika.BlockingConnection:
        """A connection to the first node that answers, starting at the one to try first; the last error if
        none does, and at once if the broker refused the credentials (the same users live on every node)."""
        error: BaseException | None = None
        n = len(self.nodes)
        for i in range(n):
            k = (self._at + i) % n
            self.node = self.nodes[k]
            try:
                conn = pika.BlockingConnection(self.node)
            except Exception as exc:
                if refused(exc):
                    raise
                error = exc
                continue
            self._at = k
            return conn
        assert error is not None
        raise error

    def lost(self) -> None:
        """The connection to ``node`` is gone: try the cluster's other nodes first (this one may be down)."""
        self._at = (self._at + 1) % len(self.nodes)

    def retry(
        self,
        open_: Callable[[], None],
        restore: Callable[[], None],
        *,
        stopping: Callable[[], bool],
        sleep: Callable[[float], None],
        failed: Callable[[BaseException], str],
        lost: Callable[[BaseException], None],
    ) -> bool:
        """Open a connection and restore what lived on the old one, backing off between attempts, until both
        succeed (True) or ``stopping()`` (False). ``failed(exc)`` records why an attempt failed and says it in
        words; ``lost(exc)`` drops a connection whose restore failed (e.g. a quorum queue still electing its
        leader right after a restart): that counts as a lost connection and is tried again."""
        delay = FIRST_DELAY
        while not stopping():
            try:
                open_()
            except Exception as exc:
                error = failed(exc)
                pause = min(self.max_backoff, delay) * random.uniform(0.5, 1.0)
                log.info("reconnect failed; retrying", error=error, retry_in=round(pause, 2))
                sleep(pause)
                delay *= 2
                continue
            try:
                restore()
            except (BrokerError, *CONNECTION_ERRORS) as exc:
                log.warning(
                    "could not restore topology or consumers after reconnect; retrying", error=str(exc)
                )
                lost(exc)
                sleep(min(self.max_backoff, delay))
                delay *= 2
                continue
            return True
        return False
