"""TLS options for ``amqps://`` connections: CA, client certificate and key, turned into pika SSLOptions."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import pika

from fedmq.broker.transport.errors import BrokerError


@dataclass(frozen=True)
class TlsOptions:
    """``ca_file`` verifies the broker; ``cert_file``/``key_file`` authenticate this client (mutual TLS).

    ``server_hostname`` defaults to the URL's host; ``verify=False`` skips broker verification (tests only).
    """

    ca_file: str | Path | None = None
    cert_file: str | Path | None = None
    key_file: str | Path | None = None
    server_hostname: str | None = None
    verify: bool = True


def ssl_options(tls: TlsOptions | None, host: str) -> pika.SSLOptions:
    """An SSLContext for ``tls`` (system CAs when no CA file is given); BrokerError on unreadable files."""
    tls = tls or TlsOptions()
    for label, path in (
        ("CA file", tls.ca_file),
        ("client certificate", tls.cert_file),
        ("client key", tls.key_file),
    ):
        if path is not None and not Path(path).is_file():
            raise BrokerError(f"TLS {label} {str(path)!r} does not exist")
    if (tls.cert_file is None) != (tls.key_file is None):
        raise BrokerError("TLS client certificate and key must be given together")
    try:
        ctx = ssl.create_default_context(cafile=str(tls.ca_file) if tls.ca_file else None)
        if not tls.verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if tls.cert_file is not None:
            ctx.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    except (ssl.SSLError, OSError) as exc:
        raise BrokerError(f"cannot load TLS files: {exc}") from None
    return pika.SSLOptions(ctx, server_hostname=tls.server_hostname or host)
