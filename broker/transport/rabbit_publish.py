"""Publishing of the RabbitMQ backend: a channel in confirm mode, ``mandatory``, persistent,
``user_id`` = this connection's user.

The chunks of one message are pipelined (up to PIPELINE in flight; each frame is encoded only when sent, from
views of the body, see pika_private.publish_frame) and their acks, nacks and returns tracked per delivery tag;
a publish stays at the head of the command queue until every part is confirmed, so after a lost connection the
unconfirmed parts are republished (a duplicate is possible and harmless: chunks are deduplicated by the
reassembler, updates by their id in the aggregator). A nacked publish is retried on a new channel until its
deadline; a publish with no confirm for ``confirm_stall_s`` goes out again on a new channel.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.exceptions as pe
import structlog

from fedmq.broker.transport import pika_private
from fedmq.broker.transport import topology as t
from fedmq.broker.transport.errors import REFUSALS, BrokerError, Undeliverable, refusal
from fedmq.broker.transport.options import ConnectOptions
from fedmq.broker.transport.queues import check_publish_args
from fedmq.broker.transport.rabbit_io import IoThread
from fedmq.broker.wire.chunk_frames import CHUNK_HEADER, Chunk, ChunkFrame, chunk_parts

log = structlog.get_logger(__name__)

PIPELINE = 8  # chunk messages of one publish in flight before waiting for confirms


def _noop() -> None:
    pass


@dataclass
class _Publish:
    exchange: str
    routing_key: str
    parts: list[tuple[bytes | Chunk, pika.BasicProperties]]  # a Chunk is encoded when sent
    deadline: float
    message_id: str
    confirmed: set[int] = field(default_factory=set)
    nacked: set[int] = field(default_factory=set)
    returned: bool = False


class Publisher:
    """publish() and the publishing channel, for RabbitBroker: the work runs on its I/O thread
    (broker.transport.rabbit_io), which opens the channel on each new connection (``open_channel``) and
    forgets it when the connection is lost (``connection_lost``). ``exchange_missing(exchange)`` is the error
    for a publish to a job exchange that is gone (the broker's topology watch reports it)."""

    def __init__(
        self,
        io: IoThread,
        user: str,
        options: ConnectOptions,
        exchange_missing: Callable[[str], BrokerError],
    ) -> None:
        # its chunk_limit, publish_timeout, connect_timeout and confirm_stall_s (no confirm for this long:
        # publish the rest again on a new channel)
        self._io, self.user, self.options = io, user, options
        self._exchange_missing = exchange_missing
        self.channel: Any = None
        self._seq = 0
        self._pending: dict[int, tuple[_Publish, int]] = {}  # delivery tag -> (publish, part)

    def publish(
        self,
        routing_key: str,
        body: bytes,
        message_id: str | None,
        headers: dict[str, Any] | None,
        timeout: float | None,
    ) -> None:
        """Broker.publish, from the caller's thread: chunk, then publish on the I/O thread and wait for every
        confirm."""
        check_publish_args(routing_key, body)
        try:
            exchange = t.exchange_for(routing_key)
        except ValueError as exc:
            raise BrokerError(str(exc)) from None
        message_id = message_id or uuid.uuid4().hex
        frames = chunk_parts(
            body if isinstance(body, bytes) else bytes(body), message_id, self.options.chunk_limit
        )
        base = dict(headers or {})

        def props(h: dict[str, Any]) -> pika.BasicProperties:
            return pika.BasicProperties(
                delivery_mode=2,
                message_id=message_id,
                user_id=self.user,
                headers=h or None,
                timestamp=int(time.time()),
            )

        parts: list[tuple[bytes | Chunk, pika.BasicProperties]]
        if frames is None:
            parts = [(body, props(base))]
        else:
            parts = [(f, props({**base, CHUNK_HEADER: 1})) for f in frames]
        timeout = timeout or self.options.publish_timeout
        job = _Publish(exchange, routing_key, parts, time.monotonic() + timeout, message_id)
        self._io.submit(lambda: self._publish_now(job), timeout, f"publish to {routing_key!r}")
        REFUSALS.clear(self.user, routing_key)

    def open_channel(self, conn: pika.BlockingConnection) -> Any:
        """A confirm-mode channel on ``conn`` whose acks/nacks/returns we track ourselves, so chunks can be
        pipelined."""
        self.channel = None
        ch = conn.channel()
        pika_private.check(conn, ch)
        ready: list[bool] = []
        pika_private.enable_confirms(
            ch,
            on_confirm=lambda f: self.on_confirm(f),  # looked up per confirm
            on_ready=lambda _f: ready.append(True),
            on_return=self._on_return,
        )
        deadline = time.monotonic() + self.options.connect_timeout * 2
        while not ready:
            if time.monotonic() > deadline or not ch.is_open:
                raise pe.AMQPConnectionError("could not enable publisher confirms")
            conn.process_data_events(time_limit=0.05)
        self.channel, self._seq = ch, 0
        self._pending.clear()
        return ch

    def connection_lost(self) -> None:
        self.channel = None

    def on_confirm(self, frame: Any) -> None:
        if self.channel is None or frame.channel_number != self.channel.channel_number:
            return  # a late confirm from a channel given up on: its delivery tags are not this channel's
        m = frame.method
        ok = isinstance(m, pika.spec.Basic.Ack)
        seqs = [s for s in self._pending if s <= m.delivery_tag] if m.multiple else [m.delivery_tag]
        for seq in seqs:
            entry = self._pending.pop(seq, None)
            if entry is not None:
                (entry[0].confirmed if ok else entry[0].nacked).add(entry[1])
        self._poke()

    def _poke(self) -> None:
        """Make the running process_data_events return now (a confirm is not an event it waits for)."""
        conn = self._io.conn
        if conn is not None:
            conn.call_later(0, _noop)

    def _on_return(self, _ch: Any, _method: Any, props: Any, _body: bytes) -> None:
        for job, _ in self._pending.values():
            if job.message_id == props.message_id:
                job.returned = True
        self._poke()

    def _publish_now(self, job: _Publish) -> None:
        """Publish every unconfirmed part of ``job`` (up to PIPELINE parts in flight) and await their
        confirms."""
        while True:
            todo = [i for i in range(len(job.parts)) if i not in job.confirmed]
            if not todo:
                return
            conn = self._io.conn
            assert conn is not None
            ch = (
                self.channel if self.channel is not None and self.channel.is_open else self.open_channel(conn)
            )
            job.nacked.clear()
            progress, done = time.monotonic(), len(job.confirmed)
            while todo or any(j is job for j, _ in self._pending.values()):
                inflight = sum(1 for j, _ in self._pending.values() if j is job)
                if todo and inflight < PIPELINE and not job.returned:
                    i = todo.pop(0)
                    data, props = job.parts[i]
                    self._seq += 1
                    self._pending[self._seq] = (job, i)
                    try:
                        if isinstance(data, Chunk):
                            pika_private.publish_frame(
                                ch, job.exchange, job.routing_key, ChunkFrame(data), props
                            )
                        else:
                            pika_private.publish(ch, job.exchange, job.routing_key, data, props)
                    except pe.ChannelWrongStateError:
                        pass  # the channel was closed by the broker: reported below
                    if (
                        len(job.parts) > 1
                    ):  # write this chunk now, so the broker works on it while we encode the next
                        conn.process_data_events(time_limit=0)
                    continue
                if job.returned and inflight == 0:
                    break
                if ch.is_closed:
                    reason = pika_private.closing_reason(ch)
                    self.channel = None
                    self._forget(job)
                    code = getattr(reason, "reply_code", "")
                    text = str(getattr(reason, "reply_text", reason))
                    if code == 404 and "no exchange" in text:
                        raise self._exchange_missing(job.exchange)
                    what = f"publish to {job.routing_key!r} refused by the broker: {code} {text}"
                    if code == 403:
                        raise refusal(self.user, job.routing_key, what)
                    raise BrokerError(what.replace("  ", " "))
                if time.monotonic() > job.deadline:
                    self._forget(job)
                    raise BrokerError(f"publish to {job.routing_key!r} not confirmed in time")
                if len(job.confirmed) > done:
                    progress, done = time.monotonic(), len(job.confirmed)
                elif (
                    time.monotonic() - progress > self.options.confirm_stall_s and not self._io.blocked
                ):  # blocked: held
                    self.abandon_channel(job)
                    break
                conn.process_data_events(time_limit=0.05)
            if job.returned:
                self._forget(job)
                raise Undeliverable(f"message to {job.routing_key!r} is unroutable: no queue is bound to it")
            if job.nacked:
                # transient right after a restart (queue leader not elected yet): retry until the deadline, on
                # a new channel: after a failover a channel can nack every publish to a quorum queue whose
                # leader moved (seen in the 3-node test for over a minute),
                # while a new one reaches the new leader
                if time.monotonic() + 0.5 >= job.deadline:
                    raise Undeliverable(f"the broker refused (nacked) the message to {job.routing_key!r}")
                log.info(
                    "publish nacked; retrying on a new channel",
                    routing_key=job.routing_key,
                    parts=len(job.nacked),
                )
                self._drop_channel()
                conn.sleep(0.5)

    def abandon_channel(self, job: _Publish) -> None:
        """No confirm for confirm_stall_s on a live connection: a confirm lost in a quorum queue's leader
        change would otherwise hold the I/O thread (and every command behind this one) until the publish
        deadline. The unconfirmed parts go out again on a new channel: at least once, and receivers drop
        duplicates by message id (chunks by message id and index)."""
        log.warning(
            "publish not confirmed; publishing again on a new channel",
            routing_key=job.routing_key,
            unconfirmed=len(job.parts) - len(job.confirmed),
            after_s=self.options.confirm_stall_s,
        )
        self._forget(job)
        self._drop_channel()

    def _drop_channel(self) -> None:
        """Close the publishing channel without waiting for close-ok (the broker's side may be the stuck
        part); the next publish opens a new one. Confirms still arriving on it are ignored
        (see on_confirm)."""
        ch, self.channel = self.channel, None
        if ch is None:
            return
        try:
            pika_private.close_now(ch)
        except Exception:  # already closing or closed
            pass

    def _forget(self, job: _Publish) -> None:
        for seq in [s for s, (j, _) in self._pending.items() if j is job]:
            del self._pending[seq]
