"""The private parts of pika the RabbitMQ backend relies on, in one place (pika is pinned below 2).

Everything else goes through pika's public API. What cannot, and why:

- Publisher confirms and returns on the channel underneath a BlockingChannel (``BlockingChannel._impl``):
  BlockingChannel.confirm_delivery makes every publish wait for its confirm, so chunks could not be pipelined,
  and BlockingChannel.add_on_return_callback defers a return to the next event dispatch, after the confirm
  that follows it on the wire has already marked the message delivered.
- Publishing on that channel without BlockingChannel.basic_publish's flush of the output (which would stop the
  I/O thread until the frame is written and raise mid-pipeline on a closed channel), and a chunk frame sent
  from views of the message body instead of one joined bytes (``_raise_if_not_open``, ``_send_method``).
- Closing a stuck channel without waiting for the broker's close-ok (``Channel.close`` underneath).
- Why the broker closed a channel (``BlockingChannel._closing_reason``).
- The server's properties (its version) and the socket read size (the transport's ``_MAX_RECV_BYTES``), on the
  connection underneath a BlockingConnection.
- The assembler of a consuming channel's content frames (``Channel._content_assembler``): a delivery whose
  content header announces more bytes than its consumer accepts is refused from that header, its body frames
  counted and dropped as they arrive instead of held until the last (:func:`bound_content`).

:func:`check` runs whenever the RabbitMQ backend opens its publishing channel (and in ``fedmq broker check``),
so a pika that moved any of these fails at connect with one line naming its version and what is missing;
:func:`bound_content` checks the content assembler the same way, on every consuming channel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pika
import pika.channel

from fedmq.broker.transport.errors import BrokerError

RECV_BYTES = 128 * 1024

# every attribute this module reaches, from the BlockingConnection and a BlockingChannel of it
_REQUIRED = (
    "BlockingConnection._impl.server_properties",
    "BlockingConnection._impl._transport._MAX_RECV_BYTES",
    "BlockingChannel._closing_reason",
    "BlockingChannel._impl.confirm_delivery",
    "BlockingChannel._impl.add_on_return_callback",
    "BlockingChannel._impl.basic_publish",
    "BlockingChannel._impl.close",
    "BlockingChannel._impl._raise_if_not_open",
    "BlockingChannel._impl._send_method",
)


def check(conn: Any, ch: Any = None) -> None:
    """BrokerError (permanent, one line) unless every attribute this module uses is on ``conn`` and ``ch``
    (those of a channel only when one is given)."""
    roots = {"BlockingConnection": conn, "BlockingChannel": ch}
    missing: list[str] = []
    for path in _REQUIRED:
        root, *names = path.split(".")
        obj = roots[root]
        if obj is None:
            continue
        for i, name in enumerate(names):
            if not hasattr(obj, name):
                gone = ".".join([root, *names[: i + 1]])
                if gone not in missing:
                    missing.append(gone)
                break
            obj = getattr(obj, name)
    if missing:
        raise BrokerError(
            f"pika {pika.__version__} lacks what fedmq's RabbitMQ backend relies on: "
            f"{', '.join(missing)} (fedmq supports pika 1.x)",
            permanent=True,
        )


def widen_reads(conn: pika.BlockingConnection) -> None:
    """Read the socket RECV_BYTES at a time instead of pika's 4 KiB: consuming model-sized messages spends
    most of its CPU in recv calls otherwise."""
    conn._impl._transport._MAX_RECV_BYTES = RECV_BYTES


def server_properties(conn: pika.BlockingConnection) -> dict[str, Any]:
    """What the broker said about itself when the connection opened (``version``, ``product``, ...)."""
    return conn._impl.server_properties or {}


def enable_confirms(
    ch: Any,
    on_confirm: Callable[[Any], None],
    on_ready: Callable[[Any], None],
    on_return: Callable[[Any, Any, Any, bytes], None],
) -> None:
    """Confirm mode on the channel underneath ``ch``: ``on_confirm(frame)`` for every ack or nack,
    ``on_return(channel, method, properties, body)`` for every returned message, each as it arrives;
    ``on_ready(frame)`` once the broker turned confirms on."""
    ch._impl.confirm_delivery(ack_nack_callback=on_confirm, callback=on_ready)
    ch._impl.add_on_return_callback(on_return)


def publish(ch: Any, exchange: str, routing_key: str, body: bytes, props: pika.BasicProperties) -> None:
    """basic_publish with ``mandatory`` on the channel underneath ``ch``: queued for the I/O loop to write."""
    ch._impl.basic_publish(exchange, routing_key, body, props, mandatory=True)


def publish_frame(ch: Any, exchange: str, routing_key: str, frame: Any, props: pika.BasicProperties) -> None:
    """pika's Channel.basic_publish (check open, send Basic.Publish with the content) minus its ``as_bytes``,
    which would force us to join the frame into one bytes first: pika only takes ``len`` and slices of the
    body, each copied once into a 128 KiB AMQP frame, so a chunk is sent straight from the message body."""
    impl = ch._impl
    impl._raise_if_not_open()
    impl._send_method(
        pika.spec.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=True), (props, frame)
    )


def close_now(ch: Any) -> None:
    """Start closing ``ch`` without waiting for the broker's close-ok."""
    ch._impl.close()


def closing_reason(ch: Any) -> Any:
    """Why ``ch`` was closed (a ChannelClosedByBroker carries reply_code and reply_text), or None."""
    return ch._closing_reason


class _BoundedAssembler(pika.channel.ContentFrameAssembler):
    """pika's content assembler, except that a body its header announces as larger than ``limit(properties)``
    is not kept: its frames are counted and dropped, and the delivery comes out with an empty body and the
    announced size in the header ``refused_header`` (the consumer then rejects it)."""

    def __init__(self, limit: Callable[[Any], int], refused_header: str) -> None:
        super().__init__()
        self._limit, self._refused_header, self._dropping = limit, refused_header, False

    def process(self, frame_value: Any) -> Any:
        if isinstance(frame_value, pika.frame.Header):
            size, props = frame_value.body_size, frame_value.properties
            self._dropping = size > self._limit(props)
            if self._dropping:
                props.headers = {**(props.headers or {}), self._refused_header: size}
        return super().process(frame_value)

    def _handle_body_frame(self, body_frame: Any) -> Any:
        if not self._dropping:
            return super()._handle_body_frame(body_frame)
        self._seen_so_far += len(body_frame.fragment)
        header = self._header_frame
        assert header is not None
        if self._seen_so_far >= header.body_size:
            self._dropping = False
            return self._finish()
        return None


def bound_content(ch: Any, limit: Callable[[Any], int], refused_header: str) -> None:
    """Deliveries on ``ch`` whose header announces more than ``limit(properties)`` bytes are refused from
    that header (see _BoundedAssembler): a hostile sender's oversized message costs its bytes on the wire and
    nothing held here."""
    impl = ch._impl
    parts = ("_handle_body_frame", "_finish", "_seen_so_far", "_header_frame")
    assembler = getattr(impl, "_content_assembler", None)
    if not isinstance(assembler, pika.channel.ContentFrameAssembler) or not all(
        hasattr(assembler, a) for a in parts
    ):
        raise BrokerError(
            f"pika {pika.__version__} lacks what fedmq's RabbitMQ backend relies on: "
            "Channel._content_assembler (fedmq supports pika 1.x)",
            permanent=True,
        )
    impl._content_assembler = _BoundedAssembler(limit, refused_header)
