"""Consuming of the RabbitMQ backend: one channel per consumer, deliveries handed to a dispatcher thread.

A delivery whose content header announces more bytes than the consumer's limit (ChunkGate.body_limit) is
refused from that header: pika_private.bound_content drops its body frames as they arrive, and the gate
rejects it (dead-lettered from the inbox) without its bytes ever being held.

The I/O thread (broker.transport.rabbit_io) only queues each delivery; the dispatcher thread reassembles
chunks (broker.transport.reassembly) and runs the handlers, so neither a long handler nor a long training step
on another thread can stop heartbeats. Deliveries from an earlier connection or subscription can no longer be
settled (the broker requeued them): acking them is a logged no-op. A consumer the broker cancels (its queue's
replica went down with a node) is subscribed again, with backoff.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika.exceptions as pe
import structlog

from fedmq.broker.transport import pika_private
from fedmq.broker.transport.base import REFUSED_SIZE_HEADER, Delivery, Handler, ReassemblyLimits
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.reassembly import EXPIRY_CHECK_S, ChunkGate

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
    only: str | None = None  # hand over only this message id (GatedDispatch._dispatch)


class RabbitConsuming:
    """consume/cancel, settling deliveries and the dispatcher thread, for RabbitBroker.

    The broker provides ``prefetch``, ``max_message_size``, ``chunk_timeout_s``, ``publish_timeout``,
    ``consume_timeout``, ``max_backoff``, GatedDispatch's ``_dispatch`` and ``_expire_due``, and from RabbitIo
    ``_conn``, ``_io``, ``_stopping``, ``_submit`` and ``_post``."""

    prefetch: int
    max_message_size: int
    chunk_timeout_s: float
    publish_timeout: float
    consume_timeout: float
    max_backoff: float
    _conn: Any
    _io: threading.Thread
    _stopping: bool
    _submit: Callable[..., Any]
    _post: Callable[[Callable[[Any], Any]], None]
    _expire_due: Callable[[float], float]
    _dispatch: Callable[[Any, Delivery], None]

    def _init_consuming(self) -> None:
        self._subscriptions = 0
        self._consumers: dict[str, _Consumer] = {}
        self._dispatch_q: collections.deque = collections.deque()
        self._dispatch_cv = threading.Condition()
        self._dispatcher = threading.Thread(
            target=self._dispatch_loop, name="fedmq-rabbit-dispatch", daemon=True
        )

    def _subscribe(self, c: _Consumer) -> None:
        assert self._conn is not None
        ch = self._conn.channel()
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
            with self._dispatch_cv:
                self._dispatch_q.append((c, d))
                self._dispatch_cv.notify()

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
        if self._consumers.get(c.tag) is not c or c.channel is not ch:
            return
        log.warning("the broker cancelled a consumer; subscribing again", queue=c.queue)
        self._resubscribe(c, 0.5)

    def _resubscribe(self, c: _Consumer, delay: float) -> None:
        conn = self._conn

        def again() -> None:
            if self._consumers.get(c.tag) is not c or self._conn is not conn:
                return  # cancelled meanwhile, or a reconnect subscribed it again
            if c.channel is not None and c.channel.is_open:
                c.channel.close()  # gives back what the cancelled consumer held
            c.gate.reset()
            try:
                self._subscribe(c)
            except BrokerError as exc:
                log.warning("subscribing again failed; retrying", queue=c.queue, error=str(exc))
                self._resubscribe(c, min(delay * 2, self.max_backoff))

        if conn is not None:
            conn.call_later(delay, again)

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
        window = prefetch or self.prefetch
        if offset is not None and not isinstance(offset, (int, float, str)) or isinstance(offset, bool):
            raise BrokerError(f"bad stream offset {offset!r}: use an int, first, last, next or a timestamp")
        c = _Consumer(
            f"fedmq-{uuid.uuid4().hex[:12]}",
            queue,
            handler,
            window,
            ChunkGate.of(
                window,
                reassembly or ReassemblyLimits(max_message_size=self.max_message_size),
                self.chunk_timeout_s,
            ),
            offset=offset,
            only=only_message,
        )

        def run(b: RabbitConsuming) -> str:
            b._subscribe(c)
            b._consumers[c.tag] = c
            return c.tag

        # RabbitMQ 3.10 answers a consume at once, or never: a quorum queue whose node was killed within about
        # a second of declaring it comes back as a zombie (declarable, 0 messages,
        # no consume or get ever answered)
        zombie = (
            f"probably a zombie quorum queue (its node was killed within seconds of declaring it; its "
            f"messages are lost); delete it (rabbitmqctl delete_queue {queue}) and start again"
        )
        return self._submit(
            run, self.publish_timeout, f"consuming {queue!r}", stuck=(self.consume_timeout, zombie)
        )

    def cancel(self, consumer_tag: str) -> None:
        def run(b: RabbitConsuming) -> None:
            c = b._consumers.pop(consumer_tag, None)
            if c is not None and c.channel is not None and c.channel.is_open:
                c.channel.close()  # closing the channel requeues its unacked deliveries

        self._submit(run, self.publish_timeout, "cancelling a consumer")

    def _settle_raw(self, raw: tuple[int, str, int], requeue: bool | None) -> None:
        gen, tag, delivery_tag = raw

        def run(b: RabbitConsuming) -> None:
            c = b._consumers.get(tag)
            if c is None or gen != c.gen or c.channel is None or not c.channel.is_open:
                log.debug("ack/reject of a delivery from a previous connection ignored (it was requeued)")
                return
            if requeue is None:
                c.channel.basic_ack(delivery_tag)
            else:
                c.channel.basic_reject(delivery_tag, requeue=requeue)

        if threading.current_thread() is self._io:
            run(self)
        else:
            self._post(run)

    def _dispatch_loop(self) -> None:
        last_expiry = time.monotonic()
        while True:
            last_expiry = self._expire_due(last_expiry)
            with self._dispatch_cv:
                if not self._dispatch_q and not self._stopping:
                    self._dispatch_cv.wait(timeout=EXPIRY_CHECK_S)
                if self._stopping:
                    return  # unacked deliveries go back to the queue when the connection closes
                item = self._dispatch_q.popleft() if self._dispatch_q else None
            if item is None:
                continue
            c, raw = item
            if c.tag not in self._consumers or raw.tag[0] != c.gen:
                continue  # cancelled, or from a lost connection (requeued by the broker)
            self._dispatch(c, raw)
