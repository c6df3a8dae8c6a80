"""fedmq.broker.transport.pika_private: the one module that touches pika's private attributes checks them at
connect."""

from __future__ import annotations

from types import SimpleNamespace

import pika
import pytest

from fedmq.broker.transport import pika_private
from fedmq.broker.transport.connect import connect
from fedmq.broker.transport.errors import BrokerError


def _fake(missing: str = "") -> tuple[SimpleNamespace, SimpleNamespace]:
    """A connection and a channel shaped like pika's,
    each private attribute there unless it is ``missing``."""

    def ns(path: str, **attrs: object) -> SimpleNamespace:
        return SimpleNamespace(**{k: v for k, v in attrs.items() if f"{path}.{k}" != missing})

    transport = ns("BlockingConnection._impl._transport", _MAX_RECV_BYTES=4096)
    conn = ns(
        "BlockingConnection", _impl=ns("BlockingConnection._impl", server_properties={}, _transport=transport)
    )
    methods = {
        m: print
        for m in (
            "confirm_delivery",
            "add_on_return_callback",
            "basic_publish",
            "close",
            "_raise_if_not_open",
            "_send_method",
        )
    }
    ch = ns("BlockingChannel", _closing_reason=None, _impl=ns("BlockingChannel._impl", **methods))
    return conn, ch


def test_the_check_passes_on_the_installed_pika(rabbit_url):
    conn = pika.BlockingConnection(pika.URLParameters(rabbit_url))
    try:
        pika_private.check(conn, conn.channel())
    finally:
        conn.close()


@pytest.mark.parametrize(
    "missing",
    [
        "BlockingChannel._impl._send_method",
        "BlockingChannel._closing_reason",
        "BlockingConnection._impl._transport",
    ],
)
def test_a_missing_attribute_is_one_permanent_line_naming_pika_and_it(missing):
    pika_private.check(*_fake())
    with pytest.raises(BrokerError) as err:
        pika_private.check(*_fake(missing))
    message = str(err.value)
    assert len(message.splitlines()) == 1 and err.value.permanent
    assert f"pika {pika.__version__}" in message and missing in message


def test_without_the_channel_only_the_connection_is_checked():
    conn, _ = _fake("BlockingChannel._impl")
    pika_private.check(conn)
    with pytest.raises(BrokerError, match="BlockingConnection._impl.server_properties"):
        pika_private.check(_fake("BlockingConnection._impl.server_properties")[0])


def test_connecting_with_a_pika_that_moved_an_attribute_fails_at_once(rabbit_url, monkeypatch):
    monkeypatch.delattr(pika.channel.Channel, "confirm_delivery")
    with pytest.raises(BrokerError) as err:
        connect(rabbit_url, connect_timeout=2.0)
    assert err.value.permanent and len(str(err.value).splitlines()) == 1
    assert "BlockingChannel._impl.confirm_delivery" in str(err.value) and f"pika {pika.__version__}" in str(
        err.value
    )
