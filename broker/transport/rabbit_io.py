"""The RabbitMQ backend's I/O thread: the connection, the loop that owns it and its command queue.

BlockingConnection is not thread-safe, so one I/O thread owns it. It loops on ``process_data_events``
(heartbeats, consumer deliveries, confirms) and runs the commands other threads queue (publish, ack, reject,
declare, consume, cancel, queue depth); a queued command wakes it through ``add_callback_threadsafe``. Callers
of publish/declare/consume block on a future (:meth:`IoThread.submit`); ack/reject do not wait (``post``). A
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
    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)
    cancelled: bool = False
    started: float | None = None  # monotonic time the I/O thread began running it on a live connection
    losses: int = 0  # connections lost while running it


class IoThread:
    """The connection and the I/O thread that owns it, for RabbitBroker.

    Its owner passes what happens around the connection: ``opened(conn)`` on each new connection (the
    publishing channel; failing it fails the attempt), ``lost()`` when it is gone, ``restore()`` after a
    reconnect (topology and consumers again) and ``tick()`` between commands (periodic checks)."""

    def __init__(
        self,
        url: str,
        user: str,
        reconnection: Reconnection,
        *,
        opened: Callable[[pika.BlockingConnection], None],
        lost: Callable[[], None],
        restore: Callable[[], None],
        tick: Callable[[], None],
    ) -> None:
        self.url, self.user = url, user
        self.reconnection = reconnection
        self._opened, self._on_lost, self._restore, self._tick = opened, lost, restore, tick
        self._lock = threading.Lock()
        self._cmds: collections.deque[_Cmd] = collections.deque()
        self.conn: pika.BlockingConnection | None = None
        self.stopping = False
        self.blocked = False
        self.reconnects = 0
        self.last_error: str | None = None
        self._refused = (
            False  # the broker refused these credentials or this virtual host (not worth retrying)
        )
        self._wedged = False  # the I/O thread is stuck in a call the broker never answers (see consume)
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fedmq-rabbit-io", daemon=True)

    def start(self, wait_s: float) -> None:
        """Start the thread and wait for its first connection; BrokerError (permanent when the broker refused
        the credentials or the virtual host) if there is none within ``wait_s``."""
        self._thread.start()
        self._first.wait(wait_s)
        if self.conn is None:
            self.stopping = True
            self._thread.join(timeout=5)
            raise BrokerError(
                f"cannot connect to {redact(self.url)}: {self.last_error or 'timed out'}",
                permanent=self._refused,
            )

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def unconfirmed(self) -> int:
        """Commands queued and not answered yet."""
        with self._lock:
            return sum(1 for c in self._cmds if not c.cancelled and not c.future.done())

    def stop(self) -> None:
        """Stop the loop and wait for it: briefly when a command the broker is not answering holds the thread
        (a daemon), which then stays for good."""
        self.stopping = True
        self.wake()
        with self._lock:
            busy = self._wedged or any(c.started is not None and not c.future.done() for c in self._cmds)
        if not self.on_thread():
            self._thread.join(timeout=1 if busy else 15)

    def _open(self) -> None:
        conn = self.reconnection.connect()
        conn.add_on_connection_blocked_callback(self._on_blocked)
        conn.add_on_connection_unblocked_callback(self._on_unblocked)
        self.conn = conn
        self.blocked = False
        try:
            # checks pika's private attributes (pika_private.check) before using them
            self._opened(conn)
            pika_private.widen_reads(conn)
        except Exception:
            self.conn = None
            try:
                conn.close()
            except Exception:
                pass
            raise

    def _describe(self, exc: BaseException) -> str:
        return describe(exc, self.reconnection.node, self.user)

    def _failed(self, exc: BaseException) -> str:
        self.last_error = self._describe(exc)
        return self.last_error

    def _loop(self) -> None:
        try:
            self._open()
        except Exception as exc:
            self._failed(exc)
            self._refused = refused(exc) or isinstance(exc, BrokerError) and exc.permanent
            self._first.set()
            return
        self._first.set()
        log.info("connected to RabbitMQ", url=redact(self.url), user=self.user)
        while not self.stopping:
            try:
                if self.conn is None or not self.conn.is_open:
                    self._reconnect()
                    continue
                self._drain()
                if self.stopping:
                    break
                self.conn.process_data_events(time_limit=0.2)
                self._drain()
                self._tick()
            except CONNECTION_ERRORS as exc:
                self._lost(exc)
            except Exception as exc:  # keep the I/O thread alive whatever a callback did
                log.error("unexpected error in the broker I/O thread", error=f"{type(exc).__name__}: {exc}")
                self._lost(exc)
        self._shutdown()

    def _lost(self, exc: BaseException) -> None:
        self._failed(exc)
        node = self.reconnection.node
        log.warning(
            "RabbitMQ connection lost; reconnecting", error=self.last_error, node=f"{node.host}:{node.port}"
        )
        self.reconnection.lost()
        self._drop_connection()
        self._on_lost()

    def _drop_connection(self) -> None:
        try:
            if self.conn is not None and self.conn.is_open:
                self.conn.close()
        except Exception:  # it is going away anyway
            pass
        self.conn = None

    def _reconnect(self) -> None:
        if self.reconnection.retry(
            self._open,
            self._restored,
            stopping=lambda: self.stopping,
            sleep=self._sleep,
            failed=self._failed,
            lost=self._lost,
        ):
            log.info("reconnected to RabbitMQ", reconnects=self.reconnects)

    def _restored(self) -> None:
        self.reconnects += 1
        self._restore()

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(0.05)

    def _shutdown(self) -> None:
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
                    result = cmd.fn()
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

    def wake(self) -> None:
        conn = self.conn
        if conn is None:
            return
        try:
            conn.add_callback_threadsafe(lambda: None)
        except Exception:
            pass  # closed: the I/O loop drains after reconnecting

    def submit(
        self,
        fn: Callable[[], Any],
        timeout: float | None,
        what: str,
        stuck: tuple[float, str] | None = None,
    ) -> Any:
        """Run ``fn()`` on the I/O thread and wait for it, at most ``timeout`` s in all; with ``stuck``
        = (s, why), at most s once the I/O thread has started it on a live connection, and at most 3
        connections lost while running it, else a permanent BrokerError that ends with ``why``.

        The wait is sliced, so a signal handler in the calling (main) thread runs within half a second."""
        if self.stopping:
            raise BrokerError("the broker connection is closed")
        if self.on_thread():
            return fn()
        cmd = _Cmd(fn)
        with self._lock:
            self._cmds.append(cmd)
        self.wake()
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
                        f"(last: {self.last_error}): {stuck[1]}",
                        permanent=True,
                    ) from None
                if deadline is not None and now >= deadline:
                    cmd.cancelled = True
                    raise BrokerError(
                        f"{what} not confirmed within {timeout:.0f} s (connected: {self.conn is not None})"
                    ) from None

    def post(self, fn: Callable[[], Any]) -> None:
        """Queue a command without waiting (acks and rejects)."""
        with self._lock:
            self._cmds.append(_Cmd(fn))
        self.wake()

    def _on_blocked(self, _conn: Any, frame: Any) -> None:
        self.blocked = True
        reason = getattr(getattr(frame, "method", None), "reason", "")
        log.warning("RabbitMQ blocked this connection (flow control)", reason=reason)

    def _on_unblocked(self, _conn: Any, _frame: Any) -> None:
        self.blocked = False
        log.info("RabbitMQ unblocked this connection")
