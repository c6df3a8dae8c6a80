"""The RabbitMQ backend's I/O thread and its command queue.

BlockingConnection is not thread-safe, so one I/O thread owns it. It loops on ``process_data_events``
(heartbeats, consumer deliveries, confirms) and runs the commands other threads queue (publish, ack, reject,
declare, consume, cancel, queue depth); a queued command wakes it through ``add_callback_threadsafe``. Callers
of publish/declare/consume block on a future (:meth:`RabbitIo._submit`); ack/reject do not wait (``_post``). A
command interrupted by a lost connection stays at the head of the queue and runs again once the connection is
back (broker.transport.rabbit_reconnect says where and when to connect).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import pika
import structlog

from fedmq.broker.transport import pika_private
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.rabbit_reconnect import CONNECTION_ERRORS, Reconnection, describe, refused
from fedmq.broker.transport.urls import redact

log = structlog.get_logger(__name__)


@dataclass
class _Cmd:
    fn: Callable[[Any], Any]
    future: Future = field(default_factory=Future)
    cancelled: bool = False
    started: float | None = None  # monotonic time the I/O thread began running it on a live connection
    losses: int = 0  # connections lost while running it


class RabbitIo:
    """The connection, the I/O thread that owns it and the command queue, for RabbitBroker.

    The broker provides ``url``, ``user``, ``_reconnection``, ``_open_pub_channel()`` (a confirm-mode channel
    on the new connection, broker.transport.rabbit_publish), ``_restore()`` (topology and consumers again)
    and ``_tick()`` (periodic checks, run between commands)."""

    url: str
    user: str
    _reconnection: Reconnection
    _pub_ch: Any
    _open_pub_channel: Callable[[], Any]
    _restore: Callable[[], None]
    _tick: Callable[[], None]

    def _init_io(self) -> None:
        self._lock = threading.Lock()
        self._cmds: collections.deque[_Cmd] = collections.deque()
        self._conn: pika.BlockingConnection | None = None
        self._stopping = False
        self._blocked = False
        self._reconnects = 0
        self._last_error: str | None = None
        self._refused = (
            False  # the broker refused these credentials or this virtual host (not worth retrying)
        )
        self._wedged = False  # the I/O thread is stuck in a call the broker never answers (see consume)
        self._first = threading.Event()
        self._io = threading.Thread(target=self._io_loop, name="fedmq-rabbit-io", daemon=True)

    def _open(self) -> None:
        conn = self._reconnection.connect()
        conn.add_on_connection_blocked_callback(self._on_blocked)
        conn.add_on_connection_unblocked_callback(self._on_unblocked)
        self._conn, self._pub_ch = conn, None
        self._blocked = False
        try:
            # checks pika's private attributes (pika_private.check) before using them
            self._open_pub_channel()
            pika_private.widen_reads(conn)
        except Exception:
            self._conn = None
            try:
                conn.close()
            except Exception:
                pass
            raise

    def _describe(self, exc: BaseException) -> str:
        return describe(exc, self._reconnection.node, self.user)

    def _failed(self, exc: BaseException) -> str:
        self._last_error = self._describe(exc)
        return self._last_error

    def _io_loop(self) -> None:
        try:
            self._open()
        except Exception as exc:
            self._failed(exc)
            self._refused = refused(exc) or isinstance(exc, BrokerError) and exc.permanent
            self._first.set()
            return
        self._first.set()
        log.info("connected to RabbitMQ", url=redact(self.url), user=self.user)
        while not self._stopping:
            try:
                if self._conn is None or not self._conn.is_open:
                    self._reconnect()
                    continue
                self._drain()
                if self._stopping:
                    break
                self._conn.process_data_events(time_limit=0.2)
                self._drain()
                self._tick()
            except CONNECTION_ERRORS as exc:
                self._lost(exc)
            except Exception as exc:  # keep the I/O thread alive whatever a callback did
                log.error("unexpected error in the broker I/O thread", error=f"{type(exc).__name__}: {exc}")
                self._lost(exc)
        self._shutdown_io()

    def _lost(self, exc: BaseException) -> None:
        self._failed(exc)
        node = self._reconnection.node
        log.warning(
            "RabbitMQ connection lost; reconnecting", error=self._last_error, node=f"{node.host}:{node.port}"
        )
        self._reconnection.lost()
        self._drop_connection()
        self._pub_ch = None

    def _drop_connection(self) -> None:
        try:
            if self._conn is not None and self._conn.is_open:
                self._conn.close()
        except Exception:  # it is going away anyway
            pass
        self._conn = None

    def _reconnect(self) -> None:
        if self._reconnection.retry(
            self._open,
            self._restore,
            stopping=lambda: self._stopping,
            sleep=self._sleep,
            failed=self._failed,
            lost=self._lost,
        ):
            log.info("reconnected to RabbitMQ", reconnects=self._reconnects)

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stopping and time.monotonic() < deadline:
            time.sleep(0.05)

    def _shutdown_io(self) -> None:
        err = BrokerError("the broker connection is closed")
        with self._lock:
            pending = list(self._cmds)
            self._cmds.clear()
        for cmd in pending:
            if not cmd.future.done():
                cmd.future.set_exception(err)
        self._drop_connection()

    def _drain(self) -> None:
        """Run queued commands in order; a command interrupted by a lost connection stays queued."""
        while True:
            with self._lock:
                if not self._cmds:
                    return
                cmd = self._cmds[0]
            if not cmd.cancelled:
                cmd.started = time.monotonic()
                try:
                    result = cmd.fn(self)
                except CONNECTION_ERRORS:
                    cmd.started = None  # runs again once reconnected
                    cmd.losses += 1
                    raise
                except BrokerError as exc:
                    cmd.future.set_exception(exc)
                except Exception as exc:
                    cmd.future.set_exception(BrokerError(f"{type(exc).__name__}: {exc}"))
                else:
                    cmd.future.set_result(result)
            with self._lock:
                if self._cmds and self._cmds[0] is cmd:
                    self._cmds.popleft()

    def _wake(self) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            conn.add_callback_threadsafe(lambda: None)
        except Exception:
            pass  # closed: the I/O loop drains after reconnecting

    def _submit(
        self,
        fn: Callable[[Any], Any],
        timeout: float | None,
        what: str,
        stuck: tuple[float, str] | None = None,
    ) -> Any:
        """Run ``fn(broker)`` on the I/O thread and wait for it, at most ``timeout`` s in all; with ``stuck``
        = (s, why), at most s once the I/O thread has started it on a live connection, and at most 3
        connections lost while running it, else a permanent BrokerError that ends with ``why``.

        The wait is sliced, so a signal handler in the calling (main) thread runs within half a second."""
        if self._stopping:
            raise BrokerError("the broker connection is closed")
        if threading.current_thread() is self._io:
            return fn(self)
        cmd = _Cmd(fn)
        with self._lock:
            self._cmds.append(cmd)
        self._wake()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return cmd.future.result(0.5)
            except FutureTimeout:
                now = time.monotonic()
                if stuck is not None and cmd.started is not None and now - cmd.started > stuck[0]:
                    cmd.cancelled = self._wedged = True  # the I/O thread waits inside pika for an answer
                    raise BrokerError(
                        f"RabbitMQ did not confirm {what} within {stuck[0]:.0f} s: {stuck[1]}", permanent=True
                    ) from None
                if stuck is not None and cmd.losses >= 3:
                    cmd.cancelled = True
                    raise BrokerError(
                        f"RabbitMQ closed the connection {cmd.losses} times while {what} "
                        f"(last: {self._last_error}): {stuck[1]}",
                        permanent=True,
                    ) from None
                if deadline is not None and now >= deadline:
                    cmd.cancelled = True
                    raise BrokerError(
                        f"{what} not confirmed within {timeout:.0f} s (connected: {self._conn is not None})"
                    ) from None

    def _post(self, fn: Callable[[Any], Any]) -> None:
        """Queue a command without waiting (acks and rejects)."""
        with self._lock:
            self._cmds.append(_Cmd(fn))
        self._wake()

    def _on_blocked(self, _conn: Any, frame: Any) -> None:
        self._blocked = True
        reason = getattr(getattr(frame, "method", None), "reason", "")
        log.warning("RabbitMQ blocked this connection (flow control)", reason=reason)

    def _on_unblocked(self, _conn: Any, _frame: Any) -> None:
        self._blocked = False
        log.info("RabbitMQ unblocked this connection")
