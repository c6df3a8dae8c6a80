"""A client's round served over its host's connection (client_agent.host): the host reads and settles every
delivery and routes to each round what concerns it; the round reads those from its Events and publishes
through its Relay."""

from __future__ import annotations

import queue
from typing import Any, Protocol

from fedmq.broker.transport.base import Broker, Delivery
from fedmq.broker.transport.errors import BrokerError


class Owner(Protocol):
    """What owns the connection (a host): its current broker (None between connections)."""

    _broker: Broker | None


class Relay(Broker):
    """A round's view of its host's connection, whichever it is now (the host reconnects under its rounds):
    publishes and stream reads go through it; the host has settled every delivery it hands over, and the
    connection is the host's to close."""

    def __init__(self, owner: Owner) -> None:
        self.owner = owner

    @property
    def broker(self) -> Broker:
        broker = self.owner._broker
        if broker is None:
            raise BrokerError("not connected")
        return broker

    def declare_job(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("a relayed round declares nothing")

    def publish(self, routing_key: str, body: bytes, **kwargs: Any) -> None:
        self.broker.publish(routing_key, body, **kwargs)

    def consume(self, queue: str, handler: Any, **kwargs: Any) -> str:
        return self.broker.consume(queue, handler, **kwargs)

    def cancel(self, consumer_tag: str) -> None:
        self.broker.cancel(consumer_tag)

    def fetch(self, queue: str, message_id: str, **kwargs: Any) -> Delivery:
        return self.broker.fetch(queue, message_id, **kwargs)

    def ack(self, delivery: Delivery) -> None:
        pass  # the host settled it

    def reject(self, delivery: Delivery, *, requeue: bool = False) -> None:
        pass

    def queue_depth(self, queue: str) -> int:
        return self.broker.queue_depth(queue)

    def status(self) -> dict[str, Any]:
        return self.broker.status()

    def close(self) -> None:
        pass


class Events:
    """A round's announcements and steps, as its host routes them (Agent._next reads them)."""

    def __init__(self) -> None:
        self._q: queue.Queue[Delivery] = queue.Queue()

    def put(self, delivery: Delivery) -> None:
        self._q.put(delivery)

    def next(self, timeout: float | None) -> Delivery | None:
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None

    def drain(self) -> list[Delivery]:
        """What was routed here and not read (its round has ended)."""
        left = []
        while True:
            try:
                left.append(self._q.get_nowait())
            except queue.Empty:
                return left
