"""The Broker interface every transport implements (RabbitMQ via pika, and the in-process broker)."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

from broker.transport.errors import BrokerError


@dataclass(frozen=True)
class ReassemblyLimits:
    """What a consumer's incomplete chunked messages may hold: one message's size, all of them together, and
    (optionally) those of one sender (a delivery's routing key; see Reassembler)."""

    max_message_size: int = 4 * 1024**3
    max_pending_bytes: int = 4 * 1024**3
    max_pending_per_sender: int | None = None


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
    def declare_job(self, job: str, agents: list[str] | tuple[str, ...] = (), *, inbox: bool = True,
                    model_bytes: int = 0) -> None:
        """Idempotently declare the job's exchange, the aggregator inbox (if ``inbox``) and each agent's queues.

        With ``inbox`` it also declares the job's model stream, whose retention ``model_bytes`` (an upper bound
        on a global-model message) sizes (broker.transport.queues.model_stream_args).
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
    def consume(self, queue: str, handler: Handler, *, prefetch: int | None = None, offset: Any = None,
                only_message: str | None = None, reassembly: ReassemblyLimits | None = None) -> str:
        """Start consuming ``queue``; returns a consumer tag. The handler must ack or reject every delivery.

        ``offset`` (stream queues only, RabbitMQ's ``x-stream-offset``): an int, "first", "last", "next" or a
        POSIX timestamp (float seconds). ``only_message``: hand over only the message with this id; every other
        delivery is acked without being reassembled or handed over (reading one model from a stream).
        ``reassembly``: bounds on this consumer's incomplete chunked messages (default: the connection's
        max_message_size per message, 4 GiB in all).
        """

    def fetch(self, queue: str, message_id: str, *, offset: Any, timeout: float, prefetch: int = 64) -> Delivery:
        """Read the one message ``message_id`` from the stream ``queue``, starting at ``offset``; BrokerError if
        it has not arrived whole within ``timeout``. The delivery comes back acked (on a stream an ack only
        returns flow-control credit) and the consumer cancelled."""
        got: list[Delivery] = []
        done = threading.Event()

        def take(d: Delivery) -> None:
            if got:
                self.ack(d)
                return
            got.append(d)
            done.set()

        tag = self.consume(queue, take, prefetch=prefetch, offset=offset, only_message=message_id)
        try:
            if not done.wait(timeout):
                raise BrokerError(f"model {message_id} not found in {queue!r} within {timeout:.0f} s")
            self.ack(got[0])
            return got[0]
        finally:
            self.cancel(tag)

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

    def __enter__(self) -> "Broker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
