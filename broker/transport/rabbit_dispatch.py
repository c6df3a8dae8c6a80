"""The RabbitMQ backend's dispatcher thread: it takes the deliveries the I/O thread queued and runs them
through their consumers' gates (broker.transport.reassembly.GatedDispatch) and handlers. It is never the I/O
thread, so neither a long handler nor a long training step on another thread can stop heartbeats."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from fedmq.broker.transport.base import Delivery
from fedmq.broker.transport.reassembly import EXPIRY_CHECK_S, GatedDispatch


class Dispatcher:
    """A queue of (consumer, raw delivery) and the thread that dispatches them in order; ``current(c, d)``
    says whether a delivery can still be settled (else it is skipped: the broker requeued it)."""

    def __init__(self, gates: GatedDispatch, current: Callable[[Any, Delivery], bool]) -> None:
        self._gates, self._current = gates, current
        self._queue: collections.deque[tuple[Any, Delivery]] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="fedmq-rabbit-dispatch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, c: Any, d: Delivery) -> None:
        """Queue one delivery (called on the I/O thread)."""
        with self._cv:
            self._queue.append((c, d))
            self._cv.notify()

    def stop(self) -> None:
        """Stop taking deliveries; unacked ones go back to the queue when the connection closes."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    def join(self) -> None:
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(timeout=15)

    def _loop(self) -> None:
        last_expiry = time.monotonic()
        while True:
            last_expiry = self._gates.expire_due(last_expiry)
            with self._cv:
                if not self._queue and not self._stopping:
                    self._cv.wait(timeout=EXPIRY_CHECK_S)
                if self._stopping:
                    return
                item = self._queue.popleft() if self._queue else None
            if item is None:
                continue
            c, raw = item
            if self._current(c, raw):
                self._gates.dispatch(c, raw)
