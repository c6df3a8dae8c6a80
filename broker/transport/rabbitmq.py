"""The RabbitMQ backend (``amqp://``, ``amqps://``) on pika's BlockingConnection.

RabbitBroker owns one object per responsibility and wires them together in its constructor:

- the I/O thread (broker.transport.rabbit_io.IoThread): the connection, the loop that owns it and the commands
  other threads queue for it; reconnection and failover across the nodes of the URL (rabbit_reconnect);
- publishing with confirms, chunking and mandatory returns (rabbit_publish.Publisher);
- consuming: the consumers, their stream offsets and channels (rabbit_consume.Consumers);
- dispatch: the thread that reassembles chunks and runs the handlers, never the I/O thread
  (rabbit_dispatch.Dispatcher over reassembly.GatedDispatch);
- the declared jobs and the watch on their exchanges (rabbit_topology.JobTopology).

After a reconnect the I/O thread restores the topology, then the consumers. pika's private attributes are
reached only through broker.transport.pika_private, checked at connect.

Presence messages (``job.<job>.presence.<client>``) travel on a second connection of the same user, opened
at the first of them, so that a heartbeat never waits behind an upload's chunks on the publishing channel.
"""

from __future__ import annotations

import threading
from typing import Any

import pika
import pika.exceptions as pe

from fedmq.broker.transport import topology as t
from fedmq.broker.transport.base import Broker, Delivery, Handler, ReassemblyLimits
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.options import ConnectOptions
from fedmq.broker.transport.queues import job_queues
from fedmq.broker.transport.rabbit_consume import Consumers
from fedmq.broker.transport.rabbit_dispatch import Dispatcher
from fedmq.broker.transport.rabbit_io import IoThread
from fedmq.broker.transport.rabbit_publish import Publisher
from fedmq.broker.transport.rabbit_reconnect import Reconnection, node_parameters
from fedmq.broker.transport.rabbit_topology import JobTopology
from fedmq.broker.transport.reassembly import GatedDispatch
from fedmq.broker.transport.urls import redact

# what the presence lane keeps of its connection's options; the rest (its prefetch, chunk limit, message
# sizes, timeouts of consuming and confirm stalls) are the defaults
_LANE_KEEPS = (
    "user",
    "heartbeat",
    "tls",
    "connect_timeout",
    "publish_timeout",
    "max_backoff",
    "exchange_check_s",
)


class RabbitBroker(Broker):
    """One RabbitMQ connection owned by an I/O thread (see module docstring)."""

    def __init__(self, url: str, options: ConnectOptions | None = None) -> None:
        o = options or ConnectOptions()
        nodes = node_parameters(url, o.tls, o.user, o.heartbeat, o.connect_timeout)
        self.url = url
        self.user = nodes[0].credentials.username
        self.chunk_limit = o.chunk_limit
        self.publish_timeout = o.publish_timeout
        self._io = IoThread(
            url,
            self.user,
            Reconnection(nodes, o.max_backoff),
            opened=self._opened,
            lost=self._lost,
            restore=self._restore,
            tick=self._tick,
        )
        self._topology = JobTopology(self._io, self.user, o.exchange_check_s)
        self._publisher = Publisher(self._io, self.user, o, exchange_missing=self._topology.missing)
        self._consumers = Consumers(self._io, lambda c, d: self._dispatcher.put(c, d), o)
        self._gates = GatedDispatch(self._consumers.by_tag, self._consumers.settle_raw)
        self._dispatcher = Dispatcher(self._gates, self._consumers.current)
        self._lane: RabbitBroker | None = None  # presence's own connection (see module docstring)
        self._lane_lock = threading.Lock()
        self._lane_options = (  # presence's connection: no lane of its own
            ConnectOptions(**{k: getattr(o, k) for k in _LANE_KEEPS}, presence_lane=False)
            if o.presence_lane
            else None
        )
        self._io.start((o.connect_timeout * 3 + 5) * len(nodes))
        self._dispatcher.start()

    # ---- what the I/O thread does around the connection -----------------------------------------------
    def _opened(self, conn: pika.BlockingConnection) -> None:
        self._publisher.open_channel(conn)

    def _lost(self) -> None:
        self._publisher.connection_lost()

    def _restore(self) -> None:
        """After a reconnect: the declared topology again, then every consumer."""
        self._topology.restore()
        self._consumers.restore()

    def _tick(self) -> None:
        self._topology.tick()

    # ---- jobs and publishing ------------------------------------------------------------------------
    def declare_job(
        self,
        job: str,
        agents: list[str] | tuple[str, ...] = (),
        *,
        inbox: bool = True,
        model_bytes: int = 0,
        edges: tuple[int, ...] = (),
    ) -> None:
        agents_t, edges_t = tuple(agents), tuple(int(e) for e in edges)
        size = int(model_bytes)
        job_queues(job, agents_t, inbox=inbox)  # validate ids in the caller's thread
        self._io.submit(
            lambda: self._topology.declare(job, agents_t, inbox, size, edges_t),
            self.publish_timeout,
            "declaring the job",
        )

    def publish(
        self,
        routing_key: str,
        body: bytes,
        *,
        message_id: str | None = None,
        headers: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> None:
        if self._lane_options is not None and isinstance(routing_key, str) and t.is_presence(routing_key):
            lane = self._presence_lane()
            try:
                lane.publish(routing_key, body, message_id=message_id, headers=headers, timeout=timeout)
            except BrokerError:
                ex = t.exchange_for(routing_key)
                if lane._topology.gone.pop(ex, None) is not None:  # reported (once) and watched here
                    raise self._topology.missing(ex) from None
                raise
            return
        try:
            self._publisher.publish(routing_key, body, message_id, headers, timeout)
        except BrokerError:
            job = t.job_of_key(routing_key)
            if job is None or t.exchange(job) not in self._topology.gone:
                raise
            if not self._topology.declared_again(t.exchange(job)):  # only the aggregator's side declares it
                raise
            self._publisher.publish(routing_key, body, message_id, headers, timeout)

    def _presence_lane(self) -> RabbitBroker:
        with self._lane_lock:
            if self._io.stopping:
                raise BrokerError("the broker connection is closed")
            if self._lane is None:
                assert self._lane_options is not None
                self._lane = RabbitBroker(self.url, self._lane_options)
                self._lane._topology.report_missing = False
            return self._lane

    # ---- consuming ----------------------------------------------------------------------------------
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
        return self._consumers.consume(queue, handler, prefetch, offset, only_message, reassembly)

    def cancel(self, consumer_tag: str) -> None:
        self._consumers.cancel(consumer_tag)

    def ack(self, delivery: Delivery) -> None:
        self._gates.settle(delivery, None)

    def reject(self, delivery: Delivery, *, requeue: bool = False) -> None:
        self._gates.settle(delivery, requeue)

    # ---- facts and lifecycle ------------------------------------------------------------------------
    def queue_depth(self, queue: str) -> int:
        def run() -> int:
            conn = self._io.conn
            assert conn is not None
            ch = conn.channel()
            try:
                ok = ch.queue_declare(queue, passive=True)
            except pe.ChannelClosedByBroker as exc:
                if exc.reply_code == 404:
                    return 0
                raise BrokerError(
                    f"cannot read depth of {queue!r}: {exc.reply_code} {exc.reply_text}"
                ) from None
            ch.close()
            return int(ok.method.message_count)

        return self._io.submit(run, self.publish_timeout, "queue depth")

    def status(self) -> dict[str, Any]:
        io = self._io
        return {
            "url": redact(self.url),
            "user": self.user,
            "connected": io.conn is not None and not io.stopping,
            "blocked": io.blocked,
            "reconnects": io.reconnects,
            "unconfirmed": io.unconfirmed(),
            "consumers": len(self._consumers.by_tag),
            "last_error": io.last_error,
        }

    def close(self) -> None:
        if self._io.stopping:
            return
        self._io.stopping = True
        with self._lane_lock:
            lane, self._lane = self._lane, None
        if lane is not None:
            lane.close()
        self._dispatcher.stop()
        self._io.stop()
        self._dispatcher.join()
