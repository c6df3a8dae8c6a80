"""`fedmq broker provision | check | purge`: users, permissions and queues of a job on RabbitMQ.

Provisioning creates (idempotently) a vhost and, for one job, the aggregator user ``fedmq-aggregator.<job>``,
one user ``<job>.<client>`` per one-client agent and one user ``<job>.host.<host>`` per host (an agent
process serving many clients ``<host>-<n>``: client_agent/host.py) -- per job, so provisioning a second job in
the same vhost never rotates or widens the first job's users -- each with least-privilege permissions scoped
to the job:

* agent X may configure, write and read only its own queues ``fedmq.<job>.agent.X.(latest|control)``, read
  (not write) the job's model stream ``fedmq.<job>.models``, write
  to (publish on) and read (bind to) the job's exchange ``fedmq.<job>``; topic permissions on that exchange
  let it publish only ``job.<job>.(report|update|presence).X`` (and ``job.<job>.update.X.e<n>``, its update
  to edge aggregator n) and bind only ``job.<job>.(global|control)`` and its own
  ``job.<job>.(announce|grant).X``;
* host H: the same for its own queues ``fedmq.<job>.agent.H.(latest|control)`` and its own
  ``job.<job>.(announce|grant).H``; it may publish its presence ``job.<job>.presence.H`` and
  ``job.<job>.(report|update|presence).H-<n>`` for its clients (n a client number, no leading zero), and no
  other client's keys: it speaks for its own clients only;
* the aggregator may configure, write and read the job's own exchange ``fedmq.<job>`` and the job's
  ``fedmq.<job>.*`` queues, publish the job's ``global``/``control``/``model``/``announce``/``grant`` keys
  (and, for two-tier aggregation, ``edge``/``partial``: its edge aggregators run as this user) and bind only
  the job's keys.

Nobody is given configure on anything another job uses: each job has its own exchange
(broker.transport.topology.exchange), so a job's aggregator can delete or rebind its own job's plumbing and
nothing else. Provisioning replaces a user's topic permissions (those on the ``fedmq`` exchange every job of a
vhost shared in older versions, ``LEGACY_EXCHANGE``, included), so re-provisioning an old job narrows its
users.

How it talks to RabbitMQ (rabbitmqctl on the broker's machine, else the management HTTP API, with the admin
credentials of the broker URL or ``FEDMQ_BROKER_USER``/``FEDMQ_BROKER_PASSWORD``): broker.transport.admin.
Passwords are random; re-running with an existing credentials file keeps its passwords (otherwise they are
rotated). The vhost it creates and every user are tagged as fedmq's (admin.PROVISIONED_TAG, admin.owner_tag),
so that deprovisioning deletes only those; user names are global, so a job id already provisioned in another
vhost is refused in one line (admin.check_owners).
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import structlog

from fedmq.broker.transport import pika_private
from fedmq.broker.transport import topology as t
from fedmq.broker.transport.admin import Admin, Permissions, User, admin_for, local_ctl, split_url
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.queues import job_queues
from fedmq.broker.transport.urls import addresses, redact, with_credentials
from fedmq.files import write_atomic

log = structlog.get_logger(__name__)


def agent_permissions(job: str, client: str) -> Permissions:
    """One client of one job: its own queues, the job's model stream (read only), its own routing keys."""
    c = re.escape(t.check_name("client id", client))
    return _owner_permissions(job, client, rf"((report|presence)\.{c}|update\.{c}{_TO_EDGE})")


def host_permissions(job: str, host: str) -> Permissions:
    """One host of one job: its own queues, the model stream (read only), and the keys of its clients
    ``<host>-<n>`` (topology.host_client) and its own presence."""
    h = re.escape(t.check_host(host))
    n = "(0|[1-9][0-9]*)"
    return _owner_permissions(
        job, host, rf"((report|presence)\.{h}-{n}|update\.{h}-{n}{_TO_EDGE}|presence\.{h})"
    )


_TO_EDGE = r"(\.e(0|[1-9][0-9]*))?"  # an update may go to an edge aggregator (topology.rk_edge_update)


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
        topic_write=rf"^job\.{j}\.(global|control|model|(announce|grant|edge|partial)\.[^.]+)$",
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


def user_url(url: str, vhost: str, user: str, password: str) -> str:
    """The broker URL (every address of it) with this user's credentials and the vhost."""
    split_url(url)
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


def purge(url: str, job: str, agents: list[str] | tuple[str, ...] = (), edges: int = 0) -> list[str]:
    """Delete the job's inbox, model stream, the given agents' (or hosts': their queues are named alike)
    queues and its ``edges`` edge aggregators' queues; the names deleted."""
    import pika
    import pika.exceptions as pe

    # (any size: the names are what count)
    specs = job_queues(job, tuple(agents), inbox=True, model_bytes=1, edges=tuple(range(edges)))
    names = [s.name for s in specs]
    parts = split_url(url)
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
