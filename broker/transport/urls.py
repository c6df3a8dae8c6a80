"""Broker URLs: the scheme check, the addresses of a cluster URL, credentials in and out (no connection)."""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

from fedmq.broker.transport.errors import BrokerError


def redact(url: str) -> str:
    """The URL with its password replaced by ***, for messages and logs."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


def check_url(url: str) -> str:
    """The URL's scheme (amqp, amqps or memory); BrokerError (one line) for anything else.
    Connects to nothing."""
    if not isinstance(url, str) or "://" not in url:
        raise BrokerError(f"bad broker URL {url!r}: want amqp://, amqps:// or memory://", permanent=True)
    scheme = url.split("://", 1)[0].lower()
    if scheme not in ("memory", "amqp", "amqps"):
        raise BrokerError(
            f"unsupported broker URL scheme {scheme!r} in {redact(url)!r}: "
            "use amqp://, amqps:// or memory://",
            permanent=True,
        )
    return scheme


_NETLOC = re.compile(r"^(?P<scheme>[A-Za-z]+)://(?:(?P<userinfo>[^@/?#]*)@)?(?P<hosts>[^/?#]*)(?P<rest>.*)$")


def _parts(url: str) -> re.Match:
    m = _NETLOC.match(url) if isinstance(url, str) else None
    if m is None:
        raise BrokerError(
            f"bad broker URL {redact(str(url))!r}: want SCHEME://[USER:PASS@]HOST[:PORT][,HOST[:PORT]...]"
            "/VHOST",
            permanent=True,
        )
    return m


def addresses(url: str) -> list[str]:
    """One single-node URL per address of ``url``, in order: ``amqp://U:P@h1:1,h2:2/v`` gives
    ``amqp://U:P@h1:1/v`` and ``amqp://U:P@h2:2/v``. A client connects to the first that answers and, when it
    loses that node, to the next: several addresses of one RabbitMQ cluster make a client survive the loss of
    the node it was connected to. BrokerError (one line) on an empty address."""
    m = _parts(url)
    hosts = m["hosts"].split(",")
    if len(hosts) > 1 and not all(h.strip() for h in hosts):
        raise BrokerError(
            f"bad broker URL {redact(url)!r}: an empty address in the host list", permanent=True
        )
    auth = f"{m['userinfo']}@" if m["userinfo"] is not None else ""
    return [f"{m['scheme']}://{auth}{h.strip()}{m['rest']}" for h in hosts]


def with_credentials(url: str, user: str, password: str, vhost: str | None = None) -> str:
    """``url`` (every address of it) with this user and password, and this vhost when given."""
    m = _parts(url)
    rest = m["rest"] if vhost is None else "/" + quote(vhost, safe="")
    return f"{m['scheme']}://{quote(user, safe='')}:{quote(password, safe='')}@{m['hosts']}{rest}"


def url_user(url: str) -> str | None:
    """The user name in the URL, if it has one."""
    m = _parts(url)
    userinfo = m["userinfo"]
    return unquote(userinfo.split(":", 1)[0]) if userinfo else None
