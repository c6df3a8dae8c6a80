"""`fedmq broker provision | check | purge`: users, permissions and queues of a job on RabbitMQ.

Provisioning creates (idempotently) a vhost and, for one job, the aggregator user ``fedmq-aggregator.<job>``,
one user ``<job>.<client>`` per one-client agent and one user ``<job>.host.<host>`` per host (an agent
process serving many clients ``<host>-<n>``: client_agent/host.py) -- per job, so provisioning a second job in
the same vhost never rotates or widens the first job's users -- each with least-privilege permissions scoped
to the job:

* agent X may configure, write and read only its own queues ``fedmq.<job>.agent.X.(latest|control)``, read
  (not write) the job's model stream ``fedmq.<job>.models``, write
  to (publish on) and read (bind to) the job's exchange ``fedmq.<job>``; topic permissions on that exchange
  let it publish only ``job.<job>.(report|update|presence).X`` and bind only ``job.<job>.(global|control)``
  and its own ``job.<job>.(announce|grant).X``;
* host H: the same for its own queues ``fedmq.<job>.agent.H.(latest|control)`` and its own
  ``job.<job>.(announce|grant).H``; it may publish its presence ``job.<job>.presence.H`` and
  ``job.<job>.(report|update|presence).H-<n>`` for its clients (n a client number, no leading zero), and no
  other client's keys: it speaks for its own clients only;
* the aggregator may configure, write and read the job's own exchange ``fedmq.<job>`` and the job's
  ``fedmq.<job>.*`` queues, publish the job's ``global``/``control``/``model``/``announce``/``grant`` keys
  and bind only the job's keys.

Nobody is given configure on anything another job uses: each job has its own exchange
(broker.transport.topology.exchange), so a job's aggregator can delete or rebind its own job's plumbing and
nothing else. Provisioning replaces a user's topic permissions (those on the ``fedmq`` exchange every job of a
vhost shared in older versions, ``LEGACY_EXCHANGE``, included), so re-provisioning an old job narrows its
users.

How it talks to RabbitMQ: ``rabbitmqctl`` when the broker runs on this machine (no plugin needed; the
management plugin is off on a stock install and enabling it reconfigures the broker), otherwise the
management HTTP API (``http(s)://HOST:15672|15671``; the Kubernetes operator enables it), with the admin
credentials of the broker URL or ``FEDMQ_BROKER_USER``/``FEDMQ_BROKER_PASSWORD``. Passwords are random;
re-running with an existing credentials file keeps its passwords (otherwise they are rotated).

The users and their permissions go to RabbitMQ as one definitions document (RabbitMQ's own import format,
``rabbitmqctl import_definitions`` or ``POST /api/definitions``), with salted SHA-256 password hashes, never
the passwords: one request however many users. Each rabbitmqctl command starts an Erlang VM (about half a
second of CPU), and a user set up command by command took four of them. So: an existing user's tags are
replaced by none (fedmq's users need none); the hash is SHA-256 (RabbitMQ's default) whatever the broker's
``password_hashing_module``; a ``credential_validator`` is not consulted (the passwords are 48 random hex
digits).
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

import structlog

from fedmq.broker.transport import pika_private
from fedmq.broker.transport import topology as t
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.queues import job_queues
from fedmq.broker.transport.urls import addresses, redact, with_credentials
from fedmq.files import write_atomic

log = structlog.get_logger(__name__)


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


def agent_permissions(job: str, client: str) -> Permissions:
    """One client of one job: its own queues, the job's model stream (read only), its own routing keys."""
    c = re.escape(t.check_name("client id", client))
    return _owner_permissions(job, client, rf"(report|update|presence)\.{c}")


def host_permissions(job: str, host: str) -> Permissions:
    """One host of one job: its own queues, the model stream (read only), and the keys of its clients
    ``<host>-<n>`` (topology.host_client) and its own presence."""
    h = re.escape(t.check_host(host))
    return _owner_permissions(job, host, rf"((report|update|presence)\.{h}-(0|[1-9][0-9]*)|presence\.{h})")


def _owner_permissions(job: str, owner: str, writes: str) -> Permissions:
    """The queues ``owner`` (a client or a host) declares and reads, the model stream (read only: consuming
    a stream removes nothing), the announcements and grants routed to it, and the topic keys ``writes``."""
    j, o = re.escape(t.check_name("job id", job)), re.escape(owner)
    own = rf"fedmq\.{j}\.agent\.{o}\.(latest|control)"
    models = rf"fedmq\.{j}\.models"
    ex = re.escape(t.exchange(job))
    return Permissions(
        exchange=t.exchange(job),
        configure=rf"^{own}$",
        write=rf"^({ex}|{own})$",
        read=rf"^({ex}|{own}|{models})$",
        topic_write=rf"^job\.{j}\.{writes}$",
        topic_read=rf"^job\.{j}\.((global|control)|(announce|grant)\.{o})$",
    )


HOST_PREFIX = "h"  # `--hosts N` provisions hosts h0 … hN-1, the ids `agent run --host-from-hostname` takes


def host_ids(spec: str) -> list[str]:
    """``--hosts``: a count N (hosts ``h0`` … ``hN-1``) or host ids, comma separated; ValueError."""
    spec = spec.strip()
    if spec.isdigit():
        if int(spec) < 1:
            raise ValueError(f"want at least 1 host, got {spec}")
        return [f"{HOST_PREFIX}{i}" for i in range(int(spec))]
    hosts = [t.check_host(h.strip()) for h in spec.split(",")]
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"{spec!r} names a host twice")
    return hosts


def check_hosts(hosts: list[str] | tuple[str, ...], agents: list[str] | tuple[str, ...]) -> None:
    """Refuse a host whose clients ``<host>-<n>`` would be one-client agents' ids: its user could speak for
    them. ``agent`` is always refused (`broker provision --agents` names agents ``agent-<i>``)."""
    for host in hosts:
        try:
            t.check_host(host)
        except ValueError as exc:
            raise BrokerError(str(exc)) from None
        clash = [a for a in agents if t.host_of(a) == host and a.partition("-")[2].isdigit()]
        if host == "agent" or clash:
            raise BrokerError(
                f"host id {host!r} is refused: its clients {host}-<n> would be one-client agents' ids "
                f"({clash[0] if clash else 'agent-<i>'}): choose another"
            )


def aggregator_permissions(job: str) -> Permissions:
    """The aggregator of one job: the exchange and every queue and routing key of that job,
    nothing of another."""
    j, ex = re.escape(t.check_name("job id", job)), re.escape(t.exchange(job))
    # the job's own exchange fedmq.<job> and its queues fedmq.<job>.*: nothing another job uses
    mine = rf"^{ex}(\..*)?$"
    return Permissions(
        exchange=t.exchange(job),
        configure=mine,
        write=mine,
        read=mine,
        topic_write=rf"^job\.{j}\.(global|control|model|(announce|grant)\.[^.]+)$",
        topic_read=rf"^job\.{j}\..*$",
    )


_CLIENT_LIKE = re.compile(r"^agent-\d+$")  # the client ids `fedmq broker provision` gives agents


def check_job_id(job: str) -> str:
    """Refuse job ids whose users would be another job's: user names are ``<job>.<client>`` and
    ``fedmq-aggregator.<job>``, so job ``fedmq-aggregator``'s agent ``agent-0`` would be job ``agent-0``'s
    aggregator (provisioning one would rotate the other's password and give it the other's permissions)."""
    if job == t.AGGREGATOR_USER or _CLIENT_LIKE.match(job):
        other = "agent-0" if job == t.AGGREGATOR_USER else t.AGGREGATOR_USER
        raise BrokerError(
            f"job id {job!r} is refused: its users would collide with those of job {other!r} "
            f"({t.AGGREGATOR_USER}.<job> is each job's aggregator, <job>.agent-<i> its agents): "
            "choose another"
        )
    return job


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


def password_hash(password: str) -> str:
    """RabbitMQ's ``rabbit_password_hashing_sha256``: base64(salt + sha256(salt + password)), 4-byte salt."""
    salt = secrets.token_bytes(4)
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def definitions(vhost: str, users: list[User], *, new_vhost: bool) -> dict[str, Any]:
    """The RabbitMQ definitions document that puts ``users`` on ``vhost`` (and the vhost, when ``new_vhost``:
    importing an existing one would reset its description and tags)."""
    return {
        "vhosts": [{"name": vhost}] if new_vhost else [],
        "users": [
            {
                "name": u.name,
                "password_hash": password_hash(u.password),
                "hashing_algorithm": "rabbit_password_hashing_sha256",
                "tags": [],
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


def admin_for(url: str) -> Admin:
    """rabbitmqctl for a broker on this machine, else the management HTTP API (see module docstring).

    A local URL names a port, and rabbitmqctl names a node: the node (``FEDMQ_RABBITMQ_NODE``, else
    rabbitmqctl's default) must be the one listening on the URL's port, or this is one error line — never
    users and permissions silently set up on another broker than the one the URL points at."""
    parts = _split(url)
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
    parts = _split(url)
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


def _split(url: str) -> SplitResult:
    """The first address of ``url``, split: users, vhosts and queues are cluster-wide, so administration talks
    to one node."""
    parts = urlsplit(addresses(url)[0])
    if parts.scheme not in ("amqp", "amqps"):
        raise BrokerError(
            f"provisioning needs an amqp:// or amqps:// broker URL, got {url.split('://')[0]!r}"
        )
    return parts


def user_url(url: str, vhost: str, user: str, password: str) -> str:
    """The broker URL (every address of it) with this user's credentials and the vhost."""
    _split(url)
    return with_credentials(url, user, password, vhost)


def provision(
    url: str,
    *,
    vhost: str,
    job: str,
    agents: list[str],
    hosts: list[str] | tuple[str, ...] = (),
    admin: Admin | None = None,
    remove_guest: bool = False,
    passwords: dict[str, str] | None = None,
    aggregator_user: str | None = None,
) -> dict[str, Any]:
    """Create the vhost and the job's users with their permissions; returns the credentials.

    ``{"vhost", "job", "aggregator": {"username", "password", "url"}, "agents": {client id: {...}},
    "hosts": {host id: {...}}}``. Users are per job (``topology.agent_user``, ``host_user``,
    ``aggregator_user``) and so are their permissions: provisioning one job never touches another job's
    users, and no user of one job can read, write or delete anything of another. ``passwords``
    (user -> password) keeps existing passwords instead of generating new ones.
    """
    try:
        t.check_name("vhost", vhost)
        t.check_name("job id", job)
        for a in agents:
            t.check_name("client id", a)
    except ValueError as exc:
        raise BrokerError(str(exc)) from None
    check_job_id(job)
    check_hosts(hosts, agents)
    aggregator_user = aggregator_user or t.aggregator_user(job)
    users = [
        ("aggregator", None, aggregator_user, aggregator_permissions(job)),
        *[("agents", a, t.agent_user(job, a), agent_permissions(job, a)) for a in agents],
        *[("hosts", h, t.host_user(job, h), host_permissions(job, h)) for h in hosts],
    ]
    if len({u for _, _, u, _ in users}) != len(users) or set(agents) & set(hosts):
        raise BrokerError("agent and host ids must be unique and differ from the aggregator user")
    admin = admin or admin_for(url)
    passwords = dict(passwords or {})
    creds: dict[str, Any] = {"vhost": vhost, "job": job, "aggregator": None, "agents": {}, "hosts": {}}
    defined = []
    for kind, name, user, perms in users:
        password = passwords.get(user) or secrets.token_hex(24)
        defined.append(User(user, password, perms))
        entry = {"username": user, "password": password, "url": user_url(url, vhost, user, password)}
        if name is None:
            creds[kind] = entry
        else:
            creds[kind][name] = entry
    admin.define(vhost, defined)
    if remove_guest:
        admin.delete_users(["guest"])
    log.info(
        "provisioned broker users",
        vhost=vhost,
        agents=len(agents),
        hosts=len(hosts),
        removed_guest=remove_guest,
    )
    return creds


def secret_manifests(creds: dict[str, Any], namespace: str = "fedmq") -> str:
    """Kubernetes Secrets (one per agent, ``fedmq-agent-<id>``, one per host, ``fedmq-host-<id>``, plus
    ``fedmq-aggregator``) as multi-doc YAML."""
    docs = []
    entries = [
        ("fedmq-aggregator", creds["aggregator"]),
        *[(f"fedmq-agent-{a}", e) for a, e in creds["agents"].items()],
        *[(f"fedmq-host-{h}", e) for h, e in (creds.get("hosts") or {}).items()],
    ]
    for name, e in entries:
        data = "\n".join(f"  {k}: {json.dumps(e[k])}" for k in ("username", "password", "url"))
        docs.append(
            f"apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\n  namespace: {namespace}\n"
            f"  labels:\n    app.kubernetes.io/part-of: fedmq\ntype: Opaque\nstringData:\n{data}\n"
        )
    return "---\n".join(docs)


def provision_cli(
    *,
    broker: str,
    vhost: str,
    job: str,
    agents: int,
    secrets_out: str | None,
    credentials_out: Path | None,
    namespace: str,
    remove_guest: bool,
    hosts: list[str] | tuple[str, ...] = (),
) -> None:
    """The `fedmq broker provision` command: agents are named agent-0 … agent-N-1."""
    import sys

    try:
        t.check_name("job id", job)
    except ValueError as exc:
        raise BrokerError(str(exc)) from None
    check_job_id(job)
    if agents < 0 or (agents == 0 and not hosts):
        raise BrokerError(f"--agents must be at least 1 (or give --hosts), got {agents}")
    old: dict[str, str] = {}
    if credentials_out is not None and Path(credentials_out).is_file():
        try:
            prev = json.loads(Path(credentials_out).read_text())
            entries = [prev.get("aggregator") or {}, *(prev.get("agents") or {}).values()]
            for e in [*entries, *(prev.get("hosts") or {}).values()]:
                if e.get("username") and e.get("password"):
                    old[e["username"]] = e["password"]
        except (OSError, ValueError, AttributeError):
            raise BrokerError(f"existing credentials file {credentials_out} is not valid JSON") from None
    creds = provision(
        broker,
        vhost=vhost,
        job=job,
        agents=[f"agent-{i}" for i in range(agents)],
        hosts=hosts,
        remove_guest=remove_guest,
        passwords=old,
    )
    if credentials_out is not None:
        write_atomic(Path(credentials_out), json.dumps(creds, indent=2) + "\n", private=True)
    if secrets_out == "-":
        sys.stdout.write(secret_manifests(creds, namespace))
    elif secrets_out:
        out = Path(secrets_out)
        out.mkdir(parents=True, exist_ok=True)
        for doc in secret_manifests(creds, namespace).split("---\n"):
            name = re.search(r"name: (\S+)", doc).group(1)  # type: ignore[union-attr]
            write_atomic(out / f"{name}.yaml", doc, private=True)  # passwords: never readable by others


def check(url: str, job: str | None = None) -> dict[str, Any]:
    """Reachable?, server version, max_message_size (when rabbitmqctl can tell), and the job's queues."""
    import pika
    import pika.exceptions as pe

    info: dict[str, Any] = {"url": redact(url), "reachable": False}
    if url.startswith("memory://"):
        from fedmq.broker.transport.connect import connect

        with connect(url) as b:
            info.update(reachable=True, version="in-process", max_message_size=None)
            if job:
                info["queues"] = {
                    s.name: {"messages": b.queue_depth(s.name)} for s in job_queues(job, inbox=True)
                }
        return info
    params = pika.URLParameters(addresses(url)[0])
    params.socket_timeout = params.stack_timeout = 5
    params.connection_attempts = 1
    try:
        conn = pika.BlockingConnection(params)
    except Exception as exc:
        raise BrokerError(f"cannot connect to {redact(url)}: {connect_error(exc, params)}") from None
    try:
        pika_private.check(conn)
        props = pika_private.server_properties(conn)
        version = props.get("version")
        info.update(reachable=True, version=version.decode() if isinstance(version, bytes) else version)
        ctl = local_ctl(url)  # the URL's node, or one error line
        info["max_message_size"] = ctl.facts.max_message_size if ctl and ctl.facts else None
        if job:
            queues: dict[str, Any] = {}
            for s in job_queues(job, inbox=True):
                ch = conn.channel()
                try:
                    ok = ch.queue_declare(s.name, passive=True)
                    queues[s.name] = {
                        "messages": ok.method.message_count,
                        "consumers": ok.method.consumer_count,
                    }
                    ch.close()
                except pe.ChannelClosedByBroker:
                    queues[s.name] = {"messages": 0, "consumers": 0, "missing": True}
            info["queues"] = queues
    finally:
        conn.close()
    return info


def purge(url: str, job: str, agents: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Delete the job's inbox, model stream and the given agents' (or hosts': their queues are named alike)
    queues; the names deleted."""
    import pika
    import pika.exceptions as pe

    specs = job_queues(job, tuple(agents), inbox=True, model_bytes=1)  # (any size: the names are what count)
    names = [s.name for s in specs]
    parts = _split(url)
    ctl = local_ctl(url)  # the URL's node, or one error line (never "purged" with the agents' queues left)
    if ctl is not None:  # also every agent queue of the job
        vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
        names += [q for q in ctl.queues(vhost, f"fedmq.{job}.") if q not in names]
    params = pika.URLParameters(addresses(url)[0])
    try:
        conn = pika.BlockingConnection(params)
    except Exception as exc:
        raise BrokerError(f"cannot connect to {redact(url)}: {connect_error(exc, params)}") from None
    deleted = []
    try:
        for name in names:
            ch = conn.channel()
            try:
                ch.queue_delete(name)
                deleted.append(name)
                ch.close()
            except pe.ChannelClosedByBroker as exc:
                raise BrokerError(f"cannot delete {name}: {exc.reply_code} {exc.reply_text}") from None
    finally:
        conn.close()
    return deleted


def connect_error(exc: BaseException, params: Any) -> str:
    """Why connecting with ``params`` (pika.URLParameters) failed, in words; a vhost the user may not enter
    names the way in (provisioned vhosts admit only their jobs' users)."""
    from fedmq.broker.transport.rabbit_reconnect import describe, refused

    user = params.credentials.username
    why = describe(exc, params, user)
    if refused(exc) and "virtual host" in why:
        why += (
            " (a provisioned vhost admits only its jobs' users: use a URL from the credentials file, "
            "e.g. the job's aggregator URL)"
        )
    return why
