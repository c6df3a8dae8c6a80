"""The Broker interface every transport implements (RabbitMQ via pika, and the in-process broker), and the
pull-style Subscription built on it."""

from __future__ import annotations

import collections
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

from fedmq.broker.transport.errors import BrokerError

# a connection's defaults, defined once (connect() and the backends)
PREFETCH = 64  # unacknowledged deliveries a consumer may hold
HEARTBEAT_S = 30  # AMQP heartbeat (RabbitMQ only)
CONSUME_TIMEOUT_S = (
    20.0  # how long RabbitMQ may take to confirm a subscription before the queue counts as broken
)
REFUSED_SIZE_HEADER = "x-fedmq-refused-size"  # set by a backend that dropped an oversized body unread


@dataclass(frozen=True)
class ReassemblyLimits:
    """What a consumer's incomplete chunked messages may hold: one message's size, all of them together, and
    (optionally) those of one sender (a delivery's routing key; see Reassembler)."""

    max_message_size: int = 4 * 1024**3
    max_pending_bytes: int = 4 * 1024**3
    max_pending_per_sender: int | None = None


class ConsumeArgs(TypedDict, total=False):
    """Broker.consume's keyword arguments, as Broker.subscribe and Subscription.add pass them on (one left out
    takes consume's default)."""

    prefetch: int | None
    offset: Any
    only_message: str | None
    reassembly: ReassemblyLimits | None


@dataclass
class Delivery:
    """One message handed to a consumer. Ack or reject it exactly once, from any thread."""

    body: bytes
    routing_key: str
    queue: str
    message_id: str | None = None
    user_id: str | None = None  # AMQP user_id property; RabbitMQ validates it against the connection's user
    headers: dict[str, Any] = field(default_factory=dict)
    redelivered: bool = False
    tag: Any = None  # backend-specific delivery handle


Handler = Callable[[Delivery], None]


class Broker(ABC):
    """Publish to routing keys on the job's topic exchange; consume named queues; ack/reject.

    Threading: every method is safe to call from any thread. Handlers run on the broker's dispatcher
    thread, never on the thread that does network I/O, so a slow handler cannot stop heartbeats.
    """

    url: str
    user: str

    @abstractmethod
    def declare_job(
        self,
        job: str,
        agents: list[str] | tuple[str, ...] = (),
        *,
        inbox: bool = True,
        model_bytes: int = 0,
        edges: tuple[int, ...] = (),
    ) -> None:
        """Idempotently declare the job's exchange, the aggregator inbox
        (if ``inbox``), each agent's queues and the queues of the edge aggregators ``edges``.

        With ``inbox`` it also declares the job's model stream, whose retention ``model_bytes`` (an upper
        bound on a global-model message) sizes (broker.transport.queues.model_stream_args).
        """

    @abstractmethod
    def publish(
        self,
        routing_key: str,
        body: bytes,
        *,
        message_id: str | None = None,
        headers: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Publish persistently with ``mandatory`` and wait for the broker's confirm.

        Sets ``user_id`` to this connection's user. Bodies over the chunk limit are split into chunks and
        reassembled on the consuming side. Raises BrokerError if the message is unroutable, nacked or not
        confirmed within ``timeout``.
        """

    @abstractmethod
    def consume(
        self,
        queue: str,
        handler: Handler,
        *,
        prefetch: int | None = None,
        offset: Any = None,
        only_message: str | None = None,
        reassembly: ReassemblyLimits | None = None,
    ) -> str:
        """Start consuming ``queue``; returns a consumer tag. The handler must ack or reject every delivery.

        ``offset`` (stream queues only, RabbitMQ's ``x-stream-offset``): an int, "first", "last", "next" or a
        POSIX timestamp (float seconds). ``only_message``: hand over only the message with this id; every
        other delivery is acked without being reassembled or handed over (reading one model from a stream).
        ``reassembly``: bounds on this consumer's incomplete chunked messages (default: the connection's
        max_message_size per message, 4 GiB in all).
        """

    def subscribe(self, queue: str, **consume_args: Unpack[ConsumeArgs]) -> Subscription:
        """Consume ``queue`` (arguments as for consume) into a Subscription to take deliveries from."""
        sub = Subscription(self)
        sub.add(queue, **consume_args)
        return sub

    def fetch(
        self, queue: str, message_id: str, *, offset: Any, timeout: float, prefetch: int = PREFETCH
    ) -> Delivery:
        """Read the one message ``message_id`` from the stream ``queue``, starting at ``offset``; BrokerError
        if it has not arrived whole within ``timeout``. The delivery comes back acked (on a stream an ack only
        returns flow-control credit) and the consumer cancelled."""
        with self.subscribe(queue, prefetch=prefetch, offset=offset, only_message=message_id) as sub:
            d = sub.next(timeout)
            if d is None:
                raise BrokerError(f"model {message_id} not found in {queue!r} within {timeout:.0f} s")
            sub.ack(d)
            return d

    @abstractmethod
    def cancel(self, consumer_tag: str) -> None:
        """Stop a consumer; its unacked deliveries go back to the queue."""

    @abstractmethod
    def ack(self, delivery: Delivery) -> None: ...

    @abstractmethod
    def reject(self, delivery: Delivery, *, requeue: bool = False) -> None: ...

    @abstractmethod
    def queue_depth(self, queue: str) -> int:
        """Messages ready in ``queue`` (0 if it does not exist)."""

    @abstractmethod
    def status(self) -> dict[str, Any]:
        """Connection facts for `fedmq status`: connected, blocked (flow control), reconnects, unconfirmed."""

    @abstractmethod
    def close(self) -> None:
        """Close the connection; unacked deliveries are redelivered to other consumers."""

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Subscription:
    """Pull-style consuming: the deliveries of one or more queues of a Broker,
    taken in arrival order with next().

    Built on Broker.consume with a handler that only buffers, so the prefetch window of each queue still
    bounds what is held here unsettled. Ack or reject every delivery taken. close() (or leaving a ``with``
    block) cancels the consumers: their unsettled deliveries, those still buffered included,
    go back to their queues.
    """

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.tags: list[str] = []  # consumer tags, one per queue added
        self._buffer: collections.deque[Delivery] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False

    def add(self, queue: str, **consume_args: Unpack[ConsumeArgs]) -> str:
        """Consume ``queue`` too (arguments as for Broker.consume), into the same buffer; its consumer tag."""
        tag = self.broker.consume(queue, self._put, **consume_args)
        self.tags.append(tag)
        return tag

    def _put(self, delivery: Delivery) -> None:
        with self._cv:
            if not self._closed:  # else its consumer is cancelled and the broker takes it back
                self._buffer.append(delivery)
                self._cv.notify()

    def next(self, timeout: float | None) -> Delivery | None:
        """The next delivery, waiting at most ``timeout`` s (None: for as long as it takes); None if none came
        or the subscription is closed."""
        with self._cv:
            self._cv.wait_for(lambda: self._buffer or self._closed, timeout)
            return self._buffer.popleft() if self._buffer and not self._closed else None

    def ack(self, delivery: Delivery) -> None:
        self.broker.ack(delivery)

    def reject(self, delivery: Delivery, *, requeue: bool = False) -> None:
        self.broker.reject(delivery, requeue=requeue)

    def qsize(self) -> int:
        """Deliveries buffered now, not yet taken with next() (the backlog)."""
        with self._cv:
            return len(self._buffer)

    def close(self) -> None:
        """Cancel the consumers; the buffered deliveries are dropped here and redelivered by the broker."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._buffer.clear()
            self._cv.notify_all()
        for tag in self.tags:
            self.broker.cancel(tag)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
