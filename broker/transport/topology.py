"""Names of the exchange, routing keys and queues of a job (one place, used by every backend).

In the transport, not the wire format: these names say where a message goes (AMQP addressing), which the
encoded bytes never depend on; the aggregator and the agent import them from here.

Every job has its own topic exchange, ``fedmq.<job>`` (:func:`exchange`): no exchange is shared by two jobs,
so no job's aggregator (the only user that may configure its job's exchange) can delete or rebind another
job's. Every routing key names its job (``job.<job>.…``), so a publish finds its exchange from its routing
key (:func:`exchange_for`) and the Broker interface stays a routing key and a body."""

from __future__ import annotations

import hashlib
import re

EXCHANGE_PREFIX = "fedmq"
LEGACY_EXCHANGE = "fedmq"  # the one exchange every job of a vhost shared before exchanges were per job
AGGREGATOR_USER = "fedmq-aggregator"  # the in-process broker's aggregator; provisioned ones are per job
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_name(kind: str, value: str) -> str:
    """Job and client ids go into routing keys and queue names: letters, digits, '-' and '_' only."""
    if not _NAME.match(value):
        raise ValueError(f"bad {kind} {value!r}: use 1-64 letters, digits, '-' or '_'")
    return value


def exchange(job: str) -> str:
    """The job's own topic exchange (the names of its queues extend it: ``fedmq.<job>.inbox``, …)."""
    return f"{EXCHANGE_PREFIX}.{check_name('job id', job)}"


def job_of_key(routing_key: str) -> str | None:
    """The job a routing key ``job.<job>.…`` belongs to; None for a key of no job."""
    parts = routing_key.split(".")
    if len(parts) < 3 or parts[0] != "job" or not _NAME.match(parts[1]):
        return None
    return parts[1]


def exchange_for(routing_key: str) -> str:
    """The exchange a message with ``routing_key`` is published to: its job's (ValueError for a key of no
    job)."""
    job = job_of_key(routing_key)
    if job is None:
        raise ValueError(f"routing key {routing_key!r} names no job: want job.<job>.<kind>[.<client>]")
    return exchange(job)


def missing_exchange(ex: str, vhost: str | None = None) -> str:
    """The one line that reports a job's exchange gone (deleted, or never declared)."""
    where = f" in vhost {vhost!r}" if vhost else ""
    job = ex.split(".", 1)[1] if "." in ex else ex
    return (
        f"exchange {ex!r} of job {job!r} does not exist{where}: the job's aggregator declares it "
        "(start or restart it); nothing of the job is routed meanwhile"
    )


def is_presence(routing_key: str) -> bool:
    """A presence message (``job.<job>.presence.<client>``): small, and travels apart from bulk uploads."""
    parts = routing_key.split(".")
    return len(parts) == 4 and parts[0] == "job" and parts[2] == "presence"


# routing keys (topic exchange)
def agent_user(job: str, client: str) -> str:
    """The broker user `fedmq broker provision` makes for one client of one job: users are per job, so
    provisioning one job never touches another's (client and job ids hold no '.',
    so the name is unambiguous)."""
    return f"{check_name('job id', job)}.{check_name('client id', client)}"


_HOST = re.compile(r"^[A-Za-z0-9_]{1,40}$")


def check_host(host: str) -> str:
    """A host (one agent process serving many clients) names its clients ``<host>-<n>``: its id holds no '-',
    so the host a client id belongs to is unambiguous (:func:`host_of`)."""
    if not isinstance(host, str) or not _HOST.match(host):
        raise ValueError(f"bad host id {host!r}: use 1-40 letters, digits or '_' (no '-')")
    return host


def host_client(host: str, index: int) -> str:
    """The id of client ``index`` of the population, served by ``host``."""
    return f"{host}-{index}"


def host_of(client: str) -> str:
    """The host whose clients may be named ``client`` (the part before the first '-'); '' when none."""
    host, sep, _ = client.partition("-")
    return host if sep and _HOST.match(host) else ""


def parse_clients(text: str) -> list[tuple[int, int]]:
    """A host's client numbers, ``0-2499,5000,6000-6099`` (numbers and inclusive ranges), as sorted [start,
    stop) ranges; ValueError (one line) for anything else or for overlapping parts."""
    ranges = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad client numbers {part.strip()!r}: want N or N-M, comma separated")
        start, stop = int(lo), int(hi) + 1 if sep else int(lo) + 1
        if stop <= start:
            raise ValueError(f"bad client numbers {part.strip()!r}: the range is empty")
        ranges.append((start, stop))
    ranges.sort()
    if any(a[1] > b[0] for a, b in zip(ranges, ranges[1:])):
        raise ValueError(f"client numbers {text!r} overlap")
    return ranges


def host_user(job: str, host: str) -> str:
    """The broker user of a host: it speaks for every client ``<host>-<n>`` it serves. Two dots, so it is
    never a one-client agent's user (``<job>.<client>``: ids hold no '.')."""
    return f"{check_name('job id', job)}.host.{check_host(host)}"


def is_host_user(user: str, job: str, host: str) -> bool:
    """``user`` is the broker user of host ``host`` of ``job`` (False for a host id that is not one)."""
    return _HOST.match(host) is not None and user == f"{job}.host.{host}"


def aggregator_user(job: str) -> str:
    return f"{AGGREGATOR_USER}.{check_name('job id', job)}"


def rk_global(job: str) -> str:
    return f"job.{job}.global"


def rk_model(job: str) -> str:
    """Global models, each version published once into the job's model stream."""
    return f"job.{job}.model"


def rk_control(job: str) -> str:
    return f"job.{job}.control"


def rk_announce(job: str, client: str) -> str:
    """A synchronous round's announcement, to one selected agent (unselected agents get nothing)."""
    return f"job.{job}.announce.{client}"


def rk_grant(job: str, client: str) -> str:
    """A round's upload grant, to one agent that reported."""
    return f"job.{job}.grant.{client}"


def rk_report(job: str, client: str) -> str:
    return f"job.{job}.report.{client}"


def rk_update(job: str, client: str) -> str:
    return f"job.{job}.update.{client}"


def rk_edge_update(job: str, client: str, edge: int) -> str:
    """An update routed to edge aggregator ``edge`` (two-tier aggregation): the inbox does not take it
    (its binding ``update.*`` is one word), the edge's queue does."""
    return f"job.{job}.update.{client}.{edge_name(edge)}"


def rk_edge(job: str, edge: int) -> str:
    """The root aggregator's word to edge ``edge``: a round's clients and model (edge-round)."""
    return f"job.{job}.edge.{edge_name(edge)}"


def rk_partial(job: str, edge: int) -> str:
    """An edge's partial sum of a round, to the root's inbox."""
    return f"job.{job}.partial.{edge_name(edge)}"


def edge_name(edge: int) -> str:
    """Edge ``edge``'s name in routing keys, queues and the root's records: ``e<edge>``."""
    return f"e{int(edge)}"


def edge_of(client: str, edges: int) -> int:
    """The edge aggregator (0 … edges−1) that folds ``client``'s updates: a hash of its id, so every agent,
    edge and root computes the same without being told, and clients spread evenly over the edges."""
    digest = hashlib.sha256(client.encode()).digest()
    return int.from_bytes(digest[:8], "big") % edges


def rk_presence(job: str, client: str) -> str:
    return f"job.{job}.presence.{client}"


def rk_dead(job: str) -> str:
    """Where the inbox dead-letters (no agent may publish it:
    its topic permissions stop at report/update/presence)."""
    return f"job.{job}.dead"


# queues
def q_inbox(job: str) -> str:
    """The aggregator's durable quorum queue (single active consumer): reports, updates, presence."""
    return f"fedmq.{job}.inbox"


def q_dead(job: str) -> str:
    """The inbox's dead-letter queue: what the aggregator rejected, and messages delivered more than the
    inbox's delivery limit (a message that kills its consumer each time). Kept for an operator to inspect."""
    return f"fedmq.{job}.dead"


def q_models(job: str) -> str:
    """The job's model stream (x-queue-type stream): every global model once;
    selected agents read it by offset."""
    return f"fedmq.{job}.models"


def q_latest(job: str, client: str) -> str:
    """The agent's newest-round-announcement queue (x-max-length 1): small, it carries no model."""
    return f"fedmq.{job}.agent.{client}.latest"


def q_control(job: str, client: str) -> str:
    """The agent's control queue (upload grants)."""
    return f"fedmq.{job}.agent.{client}.control"


def q_edge(job: str, edge: int) -> str:
    """Edge aggregator ``edge``'s queue (two-tier aggregation): its clients' updates and the root's word."""
    return f"fedmq.{job}.edge.{edge_name(edge)}"


def inbox_bindings(job: str) -> list[str]:
    return [
        f"job.{job}.report.*",
        f"job.{job}.update.*",
        f"job.{job}.presence.*",
        f"job.{job}.partial.*",
    ]


def edge_bindings(job: str, edge: int) -> list[str]:
    """The root's word to this edge and the job's end (control), and the updates routed to it."""
    return [rk_edge(job, edge), rk_control(job), f"job.{job}.update.*.{edge_name(edge)}"]
