"""Consuming of the RabbitMQ backend: one channel per consumer, deliveries handed to a dispatcher thread.

A delivery whose content header announces more bytes than the consumer's limit (ChunkGate.body_limit) is
refused from that header: pika_private.bound_content drops its body frames as they arrive, and the gate
rejects it (dead-lettered from the inbox) without its bytes ever being held.

The I/O thread (broker.transport.rabbit_io) only queues each delivery; the dispatcher thread
(broker.transport.rabbit_dispatch) reassembles chunks (broker.transport.reassembly) and runs the handlers.
Deliveries from an earlier connection or subscription can no longer be settled (the broker requeued them):
acking them is a logged no-op. A consumer the broker cancels (its queue's replica went down with a node) is
subscribed again, with backoff.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika.exceptions as pe
import structlog

from fedmq.broker.transport import pika_private
from fedmq.broker.transport.base import REFUSED_SIZE_HEADER, Delivery, Handler, ReassemblyLimits
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.options import ConnectOptions
from fedmq.broker.transport.rabbit_io import IoThread
from fedmq.broker.transport.reassembly import ChunkGate

log = structlog.get_logger(__name__)


@dataclass
class _Consumer:
    tag: str
    queue: str
    handler: Handler
    prefetch: int
    gate: ChunkGate
    channel: Any = None
    gen: int = -1
    offset: Any = None  # stream queues: x-stream-offset
    only: str | None = None  # hand over only this message id (GatedDispatch.dispatch)


class Consumers:
    """consume/cancel and settling raw deliveries, for RabbitBroker: the work runs on its I/O thread
    (broker.transport.rabbit_io); ``deliver(consumer, delivery)`` hands each delivery on to the dispatcher
    thread (broker.transport.rabbit_dispatch). ``by_tag`` holds the consumers wanted, subscribed again after
    a reconnect (``restore``)."""

    def __init__(
        self,
        io: IoThread,
        deliver: Callable[[_Consumer, Delivery], None],
        options: ConnectOptions,
    ) -> None:
        # its prefetch, max_message_size, chunk_timeout_s (an incomplete chunked message is dropped this long
        # after its last chunk), publish_timeout, consume_timeout (a subscription the broker has not confirmed
        # by then is stuck) and max_backoff
        self._io, self._deliver, self.options = io, deliver, options
        self._subscriptions = 0
        self.by_tag: dict[str, _Consumer] = {}

    def restore(self) -> None:
        """After a reconnect: every consumer again (its gate's raw tags are void)."""
        for c in list(self.by_tag.values()):
            c.gate.reset()
            self._subscribe(c)

    def current(self, c: _Consumer, d: Delivery) -> bool:
        """Whether ``d`` (queued for ``c``) can still be settled: ``c`` is not cancelled and ``d`` is not from
        a lost connection (the broker requeued it)."""
        return c.tag in self.by_tag and d.tag[0] == c.gen

    def _subscribe(self, c: _Consumer) -> None:
        assert self._io.conn is not None
        ch = self._io.conn.channel()
        pika_private.bound_content(ch, c.gate.body_limit, REFUSED_SIZE_HEADER)
        ch.basic_qos(prefetch_count=c.prefetch)
        self._subscriptions += 1
        gen = (
            self._subscriptions
        )  # deliveries of an earlier subscription (or connection) can no longer be settled

        def on_message(_ch: Any, method: Any, props: Any, body: bytes) -> None:
            d = Delivery(
                body=body,
                routing_key=method.routing_key,
                queue=c.queue,
                message_id=props.message_id,
                user_id=props.user_id,
                headers=dict(props.headers or {}),
                redelivered=method.redelivered,
                tag=(gen, c.tag, method.delivery_tag),
            )
            self._deliver(c, d)

        ch.add_on_cancel_callback(lambda _frame: self._on_cancelled(c, ch))
        args = None
        if c.offset is not None:  # a timestamp travels as an AMQP timestamp, which pika writes for a datetime
            off = c.offset
            if isinstance(off, float):
                off = datetime.datetime.fromtimestamp(int(off), tz=datetime.UTC)
            args = {"x-stream-offset": off}
        try:
            ch.basic_consume(c.queue, on_message, auto_ack=False, consumer_tag=c.tag, arguments=args)
        except pe.ChannelClosedByBroker as exc:
            raise BrokerError(f"cannot consume {c.queue!r}: {exc.reply_code} {exc.reply_text}") from None
        c.channel, c.gen = ch, gen

    def _on_cancelled(self, c: _Consumer, ch: Any) -> None:
        """The broker cancelled a consumer (its queue's member on a lost node, a deleted queue): subscribe
        again, with backoff, for as long as the consumer is wanted."""
        if self.by_tag.get(c.tag) is not c or c.channel is not ch:
            return
        log.warning("the broker cancelled a consumer; subscribing again", queue=c.queue)
        self._resubscribe(c, 0.5)

    def _resubscribe(self, c: _Consumer, delay: float) -> None:
        conn = self._io.conn

        def again() -> None:
            if self.by_tag.get(c.tag) is not c or self._io.conn is not conn:
                return  # cancelled meanwhile, or a reconnect subscribed it again
            if c.channel is not None and c.channel.is_open:
                c.channel.close()  # gives back what the cancelled consumer held
            c.gate.reset()
            try:
                self._subscribe(c)
            except BrokerError as exc:
                log.warning("subscribing again failed; retrying", queue=c.queue, error=str(exc))
                self._resubscribe(c, min(delay * 2, self.options.max_backoff))

        if conn is not None:
            conn.call_later(delay, again)

    def consume(
        self,
        queue: str,
        handler: Handler,
        prefetch: int | None,
        offset: Any,
        only: str | None,
        limits: ReassemblyLimits | None,
    ) -> str:
        """Broker.consume, from the caller's thread: subscribe on the I/O thread and wait for it."""
        window = prefetch or self.options.prefetch
        if offset is not None and not isinstance(offset, (int, float, str)) or isinstance(offset, bool):
            raise BrokerError(f"bad stream offset {offset!r}: use an int, first, last, next or a timestamp")
        c = _Consumer(
            f"fedmq-{uuid.uuid4().hex[:12]}",
            queue,
            handler,
            window,
            ChunkGate.of(
                window,
                limits or ReassemblyLimits(max_message_size=self.options.max_message_size),
                self.options.chunk_timeout_s,
            ),
            offset=offset,
            only=only,
        )

        def run() -> str:
            self._subscribe(c)
            self.by_tag[c.tag] = c
            return c.tag

        # RabbitMQ 3.10 answers a consume at once, or never: a quorum queue whose node was killed within about
        # a second of declaring it comes back as a zombie (declarable, 0 messages,
        # no consume or get ever answered)
        zombie = (
            f"probably a zombie quorum queue (its node was killed within seconds of declaring it; its "
            f"messages are lost); delete it (rabbitmqctl delete_queue {queue}) and start again"
        )
        return self._io.submit(
            run,
            self.options.publish_timeout,
            f"consuming {queue!r}",
            stuck=(self.options.consume_timeout, zombie),
        )

    def cancel(self, consumer_tag: str) -> None:
        def run() -> None:
            c = self.by_tag.pop(consumer_tag, None)
            if c is not None and c.channel is not None and c.channel.is_open:
                c.channel.close()  # closing the channel requeues its unacked deliveries

        self._io.submit(run, self.options.publish_timeout, "cancelling a consumer")

    def settle_raw(self, raw: tuple[int, str, int], requeue: bool | None) -> None:
        gen, tag, delivery_tag = raw

        def run() -> None:
            c = self.by_tag.get(tag)
            if c is None or gen != c.gen or c.channel is None or not c.channel.is_open:
                log.debug("ack/reject of a delivery from a previous connection ignored (it was requeued)")
                return
            if requeue is None:
                c.channel.basic_ack(delivery_tag)
            else:
                c.channel.basic_reject(delivery_tag, requeue=requeue)

        if self._io.on_thread():
            run()
        else:
            self._io.post(run)
