"""How fedmq administers RabbitMQ: ``rabbitmqctl`` when the broker runs on this machine (CtlAdmin; no
plugin needed: the management plugin is off on a stock install and enabling it reconfigures the broker),
otherwise the management HTTP API (HttpAdmin, ``http(s)://HOST:15672|15671``; the Kubernetes operator enables
it), with the admin credentials of the broker URL or ``FEDMQ_BROKER_USER``/``FEDMQ_BROKER_PASSWORD``.

The users and their permissions go to RabbitMQ as one definitions document (RabbitMQ's own import format,
``rabbitmqctl import_definitions`` or ``POST /api/definitions``), with salted SHA-256 password hashes, never
the passwords: one request however many users. Each rabbitmqctl command starts an Erlang VM (about half a
second of CPU), and a user set up command by command took four of them. So: an existing user's tags are
replaced by fedmq's mark of its vhost (``fedmq-vhost:<vhost>``: owner_tag); the hash is SHA-256
(RabbitMQ's default) whatever the broker's ``password_hashing_module``; a ``credential_validator`` is not
consulted (the passwords are 48 random hex digits).

Provisioning marks what it makes, and deprovisioning (broker.transport.deprovision) deletes only what
carries the mark: a vhost it created has the tag ``fedmq-provisioned`` (PROVISIONED_TAG), each user the tag
``fedmq-vhost:<vhost>`` of the vhost it was made for. A user name is global but a job id is only unique in its
vhost, so defining a user that exists and is not that vhost's (another vhost's job of the same id, or
another application's user) is refused in one line instead of rotating its password.

What to set up (users, permissions, queues of a job) is broker.transport.provision's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import SplitResult, quote, unquote, urlsplit

from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.urls import addresses


def rabbitmqctl() -> str:
    """The rabbitmqctl to run: ``FEDMQ_RABBITMQCTL`` as the environment holds it now, else the one on PATH."""
    return os.environ.get("FEDMQ_RABBITMQCTL", "rabbitmqctl")


_LOCAL = {"127.0.0.1", "localhost", "::1", ""}
_ERLANG_SAFE = re.compile(r"[A-Za-z0-9_.@-]+")  # a user name written into an Erlang binary literal as it is


@dataclass(frozen=True)
class Permissions:
    exchange: str  # the job's exchange, which the topic permissions are on
    configure: str
    write: str
    read: str
    topic_write: str
    topic_read: str


@dataclass(frozen=True)
class User:
    name: str
    password: str
    permissions: Permissions


class Admin(Protocol):
    def define(self, vhost: str, users: list[User]) -> None:
        """Create ``vhost`` if it is missing and put ``users`` with their passwords and permissions on it,
        their topic permissions on other exchanges removed."""

    def delete_users(self, users: Sequence[str]) -> None:
        """Delete ``users`` in one request; those already gone are skipped."""

    def delete_vhost(self, vhost: str) -> None: ...


PROVISIONED_TAG = (
    "fedmq-provisioned"  # a vhost `fedmq broker provision` created: only such a vhost is deleted
)
_OWNER = "fedmq-vhost:"


def owner_tag(vhost: str) -> str:
    """The tag that marks a user fedmq made for ``vhost``."""
    return _OWNER + vhost


def owner_vhosts(tags: Sequence[str]) -> list[str]:
    """The vhosts a user's tags say fedmq made it for (none: not marked, e.g. made by an older version)."""
    return [tag[len(_OWNER) :] for tag in tags if tag.startswith(_OWNER)]


def tag_list(text: str) -> list[str]:
    """Tags as rabbitmqctl prints them (``[a, b]``) or older management APIs give them (``a,b``)."""
    return [tag.strip() for tag in text.strip().strip("[]").split(",") if tag.strip()]


def check_owners(vhost: str, users: list[User], held: dict[str, list[str]], in_vhost: set[str]) -> None:
    """Refuse, in one line, to redefine a user that exists and is not fedmq's for ``vhost``: marked for
    another vhost, or unmarked and without topic permissions in ``vhost`` (``in_vhost``: fedmq's users of
    older versions have them). ``held``: every user with its tags."""
    taken = []
    for u in users:
        if u.name in held:
            owners = owner_vhosts(held[u.name])
            if (vhost not in owners) if owners else (u.name not in in_vhost):
                taken.append(u.name + (f" (vhost {owners[0]!r})" if owners else ""))
    if taken:
        raise BrokerError(
            f"user(s) {', '.join(taken[:3])}{' …' if len(taken) > 3 else ''} already exist and are not "
            f"fedmq's for vhost {vhost!r}: deprovision that job or choose another job id"
        )


def password_hash(password: str) -> str:
    """RabbitMQ's ``rabbit_password_hashing_sha256``: base64(salt + sha256(salt + password)), 4-byte salt."""
    salt = secrets.token_bytes(4)
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def definitions(vhost: str, users: list[User], *, new_vhost: bool) -> dict[str, Any]:
    """The RabbitMQ definitions document that puts ``users`` on ``vhost`` (and the vhost, when ``new_vhost``:
    importing an existing one would reset its description and tags), each marked as fedmq's (module
    docstring)."""
    made = {"name": vhost, "description": "created by fedmq broker provision", "tags": [PROVISIONED_TAG]}
    return {
        "vhosts": [made] if new_vhost else [],
        "users": [
            {
                "name": u.name,
                "password_hash": password_hash(u.password),
                "hashing_algorithm": "rabbit_password_hashing_sha256",
                "tags": [owner_tag(vhost)],
            }
            for u in users
        ],
        "permissions": [
            {
                "user": u.name,
                "vhost": vhost,
                "configure": u.permissions.configure,
                "write": u.permissions.write,
                "read": u.permissions.read,
            }
            for u in users
        ],
        "topic_permissions": [
            {
                "user": u.name,
                "vhost": vhost,
                "exchange": u.permissions.exchange,
                "write": u.permissions.topic_write,
                "read": u.permissions.topic_read,
            }
            for u in users
        ],
    }


def stale_topic_permissions(users: list[User], held: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (user, exchange) topic permissions of ``users`` (``held``: all of the vhost's) on an exchange not
    theirs (the shared one of older versions): an import adds theirs beside those, so they are cleared after
    it (before it, the user could route any key on that exchange meanwhile)."""
    own = {u.name: u.permissions.exchange for u in users}
    return sorted({(user, exchange) for user, exchange in held if user in own and exchange != own[user]})


@dataclass(frozen=True)
class NodeFacts:
    """What rabbitmqctl tells of its node: where it listens and the largest message it takes."""

    amqp_ports: list[int]
    max_message_size: int | None  # None: the node's default (not set in its configuration)


class CtlAdmin:
    """rabbitmqctl on this machine (optionally ``-n NODE``)."""

    facts: NodeFacts | None = None  # set by local_ctl, which checks the node against the URL's port

    def __init__(
        self, node: str | None = None, ctl: str | None = None, env: dict[str, str] | None = None
    ) -> None:
        ctl = ctl or rabbitmqctl()
        self.node, self.ctl, self.env = node, ctl, env
        if shutil.which(ctl) is None and not Path(ctl).is_file():
            raise BrokerError(f"{ctl} not found: run on the broker's machine or use the management API")

    def run(
        self, *args: str, ok_codes: tuple[int, ...] = (0,), ok_text: str = "", stdin: str | None = None
    ) -> str:
        cmd = [self.ctl, *(["-n", self.node] if self.node else []), *args]
        proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120, env=self.env)
        out = (proc.stdout or "") + (proc.stderr or "")
        if proc.returncode not in ok_codes and not (ok_text and ok_text in out):
            last = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()[-1]
            raise BrokerError(f"rabbitmqctl {args[0]} failed: {last}")
        return out

    def define(self, vhost: str, users: list[User]) -> None:
        gone = f"Virtual host '{vhost}' does not exist"
        out = self.run("list_topic_permissions", "-p", vhost, "--quiet", "--no-table-headers", ok_text=gone)
        rows = [r for r in (line.split("\t") for line in out.splitlines()) if len(r) >= 2]
        listed = self.run("list_users", "--quiet", "--no-table-headers")
        held = {
            r[0]: tag_list(r[1]) for r in (line.split("\t") for line in listed.splitlines()) if len(r) >= 2
        }
        check_owners(vhost, users, held, {r[0] for r in rows})
        doc = definitions(vhost, users, new_vhost=not rows and gone in out)
        self.run("import_definitions", "--format", "json", stdin=json.dumps(doc))
        for user, exchange in stale_topic_permissions(users, [(r[0], r[1]) for r in rows]):
            self.run("clear_topic_permissions", "-p", vhost, user, exchange)

    def delete_users(self, users: Sequence[str]) -> None:
        """One ``rabbitmqctl eval`` per 500 users: a ``delete_user`` command each starts an Erlang VM each
        (a quarter of a second or more: minutes for a job of 1,000 agents), and 500 names keep the expression
        far below the kernel's limit on one argument (128 KiB). A name the Erlang literal cannot hold as it
        is goes through ``delete_user``."""
        plain = [u for u in users if _ERLANG_SAFE.fullmatch(u)]
        for user in set(users) - set(plain):
            self.run("delete_user", user, ok_text="does not exist")
        for start in range(0, len(plain), 500):
            names = ", ".join(f'<<"{u}">>' for u in plain[start : start + 500])
            # what failed, other than a user already gone: [] when every one is deleted
            out = self.run(
                "eval",
                f"[{{U, R}} || U <- [{names}], "
                'R <- [catch rabbit_auth_backend_internal:delete_user(U, <<"rmq-cli">>)], '
                "R =/= ok, R =/= {error, {no_such_user, U}}].",
            )
            if "[]" not in (line.strip() for line in out.splitlines()):  # (stderr may hold node warnings)
                raise BrokerError(f"rabbitmqctl could not delete users: {' '.join(out.split())[:300]}")

    def delete_vhost(self, vhost: str) -> None:
        self.run("delete_vhost", vhost, ok_text="does not exist")

    def queues(self, vhost: str, prefix: str) -> list[str]:
        out = self.run("list_queues", "-p", vhost, "name", "--quiet", "--no-table-headers")
        return [q.strip() for q in out.splitlines() if q.strip().startswith(prefix)]

    def node_facts(self) -> NodeFacts:
        """The AMQP ports the node listens on (plain and TLS) and its max_message_size, in one eval: each
        rabbitmqctl command starts an Erlang VM, and `fedmq broker check` wants both."""
        out = self.run(
            "eval",
            "{fedmq, [P || {listener, _, Proto, _, _, P, _} <- rabbit_networking:active_listeners(), "
            "lists:member(Proto, [amqp, 'amqp/ssl'])], application:get_env(rabbit, max_message_size)}.",
        )
        m = re.search(r"\{fedmq,\s*\[([\d,\s]*)\],\s*(?:\{ok,\s*(\d+)\}|\w+)\}", out)
        if m is None:
            raise BrokerError(f"rabbitmqctl eval gave no listeners: {' '.join(out.split())[:300]}")
        ports = sorted({int(p) for p in re.findall(r"\d+", m.group(1))})
        return NodeFacts(ports, int(m.group(2)) if m.group(2) else None)


class HttpAdmin:
    """The management plugin's HTTP API (for brokers on other machines, e.g. the Kubernetes operator's)."""

    def __init__(self, base: str, user: str, password: str, context: ssl.SSLContext | None = None) -> None:
        self.base, self.context = base.rstrip("/"), context
        self.auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    def call(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200, 201, 204)) -> Any:
        req = urllib.request.Request(
            self.base + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"authorization": self.auth, "content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30, context=self.context) as resp:
                data = resp.read()
                return json.loads(data) if data else None
        except urllib.error.HTTPError as exc:
            if exc.code in ok:
                return None
            raise BrokerError(
                f"management API {method} {path} failed: HTTP {exc.code} {exc.reason}"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            raise BrokerError(f"management API at {self.base} unreachable: {exc}") from None

    def define(self, vhost: str, users: list[User]) -> None:
        v = quote(vhost, safe="")
        held = self.call("GET", f"/api/vhosts/{v}/topic-permissions", ok=(404,))
        users_held = {r["name"]: http_tags(r.get("tags")) for r in self.call("GET", "/api/users") or []}
        check_owners(vhost, users, users_held, {h["user"] for h in held or []})
        self.call("POST", "/api/definitions", definitions(vhost, users, new_vhost=held is None))
        stale = stale_topic_permissions(users, [(h["user"], h["exchange"]) for h in held or []])
        for u in [u for u in users if u.name in {user for user, _ in stale}]:
            # the API deletes a user's topic permissions on every exchange at once: its own go back at once
            path, p = f"/api/topic-permissions/{v}/{quote(u.name, safe='')}", u.permissions
            self.call("DELETE", path, ok=(404,))
            self.call("PUT", path, {"exchange": p.exchange, "write": p.topic_write, "read": p.topic_read})

    def delete_users(self, users: Sequence[str]) -> None:
        """``bulk-delete`` refuses the whole list (400) for one user already gone: those are left out."""
        held = {row.get("name") for row in self.call("GET", "/api/users") or [] if isinstance(row, dict)}
        if present := [u for u in users if u in held]:
            self.call("POST", "/api/users/bulk-delete", {"users": present})

    def delete_vhost(self, vhost: str) -> None:
        self.call("DELETE", f"/api/vhosts/{quote(vhost, safe='')}", ok=(404,))


def http_tags(tags: object) -> list[str]:
    """A user's or vhost's tags from the management API: a list (RabbitMQ 3.9 and later) or a string."""
    return [str(tag) for tag in tags] if isinstance(tags, list) else tag_list(str(tags or ""))


def admin_for(url: str) -> Admin:
    """rabbitmqctl for a broker on this machine, else the management HTTP API (see module docstring).

    A local URL names a port, and rabbitmqctl names a node: the node (``FEDMQ_RABBITMQ_NODE``, else
    rabbitmqctl's default) must be the one listening on the URL's port, or this is one error line — never
    users and permissions silently set up on another broker than the one the URL points at."""
    parts = split_url(url)
    local = local_ctl(url)
    if local is not None:
        return local
    user = os.environ.get("FEDMQ_BROKER_USER") or (unquote(parts.username) if parts.username else "guest")
    password = os.environ.get("FEDMQ_BROKER_PASSWORD") or (
        unquote(parts.password) if parts.password else "guest"
    )
    tls = parts.scheme == "amqps"
    api_port = os.environ.get("FEDMQ_MANAGEMENT_PORT") or ("15671" if tls else "15672")
    base = f"{'https' if tls else 'http'}://{parts.hostname}:{api_port}"
    return HttpAdmin(base, user, password, ssl.create_default_context() if tls else None)


def local_ctl(url: str) -> CtlAdmin | None:
    """rabbitmqctl for the node of a local ``url`` (``FEDMQ_RABBITMQ_NODE``, else rabbitmqctl's default node),
    checked to listen on the URL's port; None when the URL is not local or there is no rabbitmqctl. A node on
    another port is one error line: provision, check and purge never talk to another broker than the URL's."""
    parts = split_url(url)
    ctl = rabbitmqctl()
    if (parts.hostname or "") not in _LOCAL or not (shutil.which(ctl) or Path(ctl).is_file()):
        return None
    admin = CtlAdmin(os.environ.get("FEDMQ_RABBITMQ_NODE") or None, ctl)
    port = parts.port or (5671 if parts.scheme == "amqps" else 5672)
    admin.facts = admin.node_facts()
    ports = admin.facts.amqp_ports
    if port not in ports:
        node = admin.node or "rabbitmqctl's default node"
        raise BrokerError(
            f"{node} listens on port(s) {', '.join(map(str, ports)) or 'none'}, not {port}: "
            f"name the node of port {port} with FEDMQ_RABBITMQ_NODE"
        )
    return admin


def split_url(url: str) -> SplitResult:
    """The first address of ``url``, split: users, vhosts and queues are cluster-wide, so administration talks
    to one node."""
    parts = urlsplit(addresses(url)[0])
    if parts.scheme not in ("amqp", "amqps"):
        raise BrokerError(
            f"provisioning needs an amqp:// or amqps:// broker URL, got {url.split('://')[0]!r}"
        )
    return parts
