"""`fedmq agent`: the client agent service, one client per process or a host serving many."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from fedmq import defaults
from fedmq.aggregator.config import JobFile
from fedmq.cli import options
from fedmq.cli.errors import UsageError
from fedmq.cli.help import HelpCommand, HelpGroup
from fedmq.cli.options import JOB
from fedmq.cli.process import make_task, prepare_process, setup_logs
from fedmq.cli.services import broker_url, job_file, metrics_endpoint, serving
from fedmq.cli.signals import stop_agent_on_signals

app = typer.Typer(cls=HelpGroup, no_args_is_help=True, help="The client agent service.")


@app.command("run", cls=HelpCommand)
def agent_run(
    broker: str = options.SERVICE_BROKER,
    job: str = typer.Option(..., envvar="FEDMQ_JOB", help="job id (the aggregator's --job)"),
    client_id: str | None = typer.Option(
        None, envvar="FEDMQ_CLIENT_ID", help="this agent's id and broker user"
    ),
    client_id_from_hostname: bool = typer.Option(
        False, help="derive the id from a StatefulSet pod name (fedmq-agent-3 → agent-3)"
    ),
    index: int | None = typer.Option(
        None, envvar="FEDMQ_CLIENT_INDEX", help="shard index (default: the id's number)"
    ),
    config: Path | None = typer.Option(None, envvar="FEDMQ_CONFIG", help="TOML file with a [task] table"),
    data: str | None = typer.Option(None, help="corpus folder, or a corpus name in $FEDMQ_DATA_DIR"),
    device: str = typer.Option("auto", envvar="FEDMQ_DEVICE", help="auto | cpu | cuda"),
    availability: str = typer.Option(
        "always", envvar="FEDMQ_AVAILABILITY", help="always|bernoulli:P|markov:A,B|trace:FILE"
    ),
    faults: str = typer.Option(
        "",
        envvar="FEDMQ_FAULTS",
        help="injected faults, comma-separated: crash-train:P, crash-grant:P, slow:P:SECONDS, cut:P",
    ),
    user: str | None = options.BROKER_USER,
    password: str | None = options.BROKER_PASSWORD,
    seed: int = typer.Option(
        0, envvar="FEDMQ_SEED", help="seed of the shards, availability and faults (the job's seed)"
    ),
    metrics_port: int = options.METRICS_PORT,
    chunk_limit: int = options.CHUNK_LIMIT,
    heartbeat: int = options.HEARTBEAT,
    consume_timeout: float = options.CONSUME_TIMEOUT,
    audit_log: Path | None = typer.Option(
        None, envvar="FEDMQ_AUDIT_LOG", help="append one JSON line per broker-confirmed upload (fault audits)"
    ),
    stop_grace: float = typer.Option(
        25.0,
        envvar="FEDMQ_STOP_GRACE",
        help="on SIGTERM/SIGINT, finish the round's local training and upload, leave the job and exit 0 "
        "within this many seconds, else exit 143 (keep it below the pod's terminationGracePeriodSeconds); "
        "a second signal exits at once",
    ),
    host: str | None = typer.Option(
        None,
        envvar="FEDMQ_HOST_ID",
        help="serve many clients in this one process, as host HOST: clients HOST-<n>, broker user "
        "<job>.host.HOST (instead of --client-id); give --clients",
    ),
    clients: str | None = typer.Option(
        None,
        envvar="FEDMQ_HOST_CLIENTS",
        metavar="RANGES",
        help="with --host: the client numbers it serves, e.g. 0-2499,5000 (inside the job's population: "
        "clients in --config, default 10)",
    ),
    host_from_hostname: bool = typer.Option(
        False,
        help="a host per StatefulSet pod: pod NAME-i is host hi and serves the i-th of --hosts equal "
        "parts of the job's population K (clients in --config): numbers i*K/N to (i+1)*K/N-1, rounded "
        "down",
    ),
    hosts: int | None = typer.Option(
        None,
        envvar="FEDMQ_HOSTS",
        metavar="N",
        help="with --host-from-hostname: N, the hosts (the StatefulSet's replicas)",
    ),
    trainers: int = typer.Option(
        defaults.TRAINERS,
        envvar="FEDMQ_TRAINERS",
        metavar="N",
        help="a host's models that train at once (its clients share them)",
    ),
    client_state: Path | None = typer.Option(
        None,
        envvar="FEDMQ_CLIENT_STATE",
        metavar="DIR",
        help="a host keeps what the job's algorithm keeps per client in files here (default: in memory)",
    ),
    log_format: str = options.LOG_FORMAT,
    log_level: str = options.LOG_LEVEL,
) -> None:
    """Run one client agent: join the job, train on its shard, upload when granted, repeat. With --host (or
    --host-from-hostname), run a host: one process and one broker connection serving many clients of the job.

    Example: fedmq agent run --broker amqps://rabbit:5671/fedmq --job wt2 --client-id agent-3
    --data /data --device cuda

    Example: fedmq agent run --broker amqps://rabbit:5671/fedmq --job wt2 --config job.toml --host h0
    --clients 0-2499
    """
    setup_logs(log_level, log_format)
    if not 0 < stop_grace <= 86400:
        raise UsageError(f"--stop-grace {stop_grace:g} must be in (0, 86400] seconds")
    jobfile = job_file(config)
    values = jobfile.job
    population = int(values.get("clients", JOB.clients))
    heartbeat_s = float(values.get("heartbeat_s", JOB.heartbeat_s))  # a host's and a one-client agent's beat
    served = _hosted_clients(
        population, host, clients, host_from_hostname, hosts, client_id, client_id_from_hostname, index
    )
    if served is None and (trainers != defaults.TRAINERS or client_state is not None):
        raise UsageError(
            "--trainers and --client-state are a host's options: give --host or --host-from-hostname"
        )
    if served is not None and trainers < 1:
        raise UsageError(f"--trainers must be at least 1, got {trainers}")
    service = _Service(
        broker,
        user,
        password,
        {"chunk_limit": chunk_limit, "heartbeat": heartbeat, "consume_timeout": consume_timeout},
        job,
        availability=availability,
        faults=faults,
        device=device,
        seed=seed,
        heartbeat_s=heartbeat_s,
        strategy=str(values.get("strategy", "")),
        audit_log=audit_log,
        metrics_port=metrics_port,
        stop_grace=stop_grace,
    )
    if served is not None:
        task_opts = _task_options(jobfile, seed, data, population)
        _run_host(service, *served, task_opts, trainers=trainers, client_state=client_state)
    else:
        _run_agent(service, client_id, client_id_from_hostname, index, jobfile, data)


@dataclasses.dataclass(frozen=True)
class _Service:
    """What a one-client agent and a host both run with: the broker, the job, the client side's settings."""

    broker: str
    user: str | None
    password: str | None
    connect_args: dict[str, Any]
    job: str
    availability: str
    faults: str
    device: str
    seed: int
    heartbeat_s: float
    strategy: str
    audit_log: Path | None
    metrics_port: int
    stop_grace: float

    def connector(self) -> Callable[[], Any]:
        """Connects to the broker; the URL with its credentials is made (a bad one: one line) at once."""
        url = broker_url(self.broker, self.user, self.password)

        def connect() -> Any:
            from fedmq.broker.transport.connect import connect

            return connect(url, **self.connect_args)

        return connect

    def client_args(self) -> dict[str, Any]:
        """The keyword arguments that client_agent's Agent and Host both take."""
        from fedmq.client_agent.availability import parse_availability, parse_faults

        return {
            "availability": parse_availability(self.availability, self.seed),
            "faults": parse_faults(self.faults, self.seed),
            "device": self.device,
            "seed": self.seed,
            "heartbeat_s": self.heartbeat_s,
            "audit_log": self.audit_log,
            "strategy": self.strategy,
        }


def _task_options(jobfile: JobFile, seed: int, data: str | None, clients: Any) -> dict[str, Any]:
    """The agent's task: the job file's [task] table, over its corpus --data, for the job's ``clients``."""
    task_opts = {"task": "lm", "data": "builtin", "seed": seed, **jobfile.task}
    if data:
        task_opts["data"] = data
    task_opts.setdefault("clients", clients)
    return task_opts


def _one_client(client_id: str | None, from_hostname: bool, index: int | None) -> tuple[str, int]:
    """A one-client agent's id and shard index: --client-id (or the pod's name) and --index (or the id's
    number)."""
    import socket

    if from_hostname:
        hostname = socket.gethostname()
        tail = hostname.rsplit("-", 1)[-1]
        client_id = "agent-" + tail if tail.isdigit() else None
        if client_id is None:
            raise UsageError(f"hostname {hostname!r} does not end in a pod ordinal (-N)")
    if not client_id:
        raise UsageError(
            "give --client-id (or FEDMQ_CLIENT_ID, or --client-id-from-hostname), or --host for many clients"
        )
    if index is None:
        tail = client_id.rsplit("-", 1)[-1]
        if not tail.isdigit():
            raise UsageError(f"cannot derive a shard index from {client_id!r}; give --index")
        index = int(tail)
    return client_id, index


def _run_agent(
    service: _Service,
    client_id: str | None,
    client_id_from_hostname: bool,
    index: int | None,
    jobfile: JobFile,
    data: str | None,
) -> None:
    """`agent run` for one client: an Agent (client_agent/agent.py) that leaves the job on SIGTERM."""
    agent = None
    stop_agent_on_signals(lambda: agent, service.stop_grace)
    client_id, index = _one_client(client_id, client_id_from_hostname, index)
    task_opts = _task_options(jobfile, service.seed, data, jobfile.job.get("clients", index + 1))
    prepare_process()  # a job file or flag that is wrong was one line before torch is loaded
    from fedmq.client_agent.agent import Agent

    task_obj = make_task(task_opts)
    agent = Agent(service.connector(), service.job, client_id, index, task_obj, **service.client_args())

    def live() -> dict[str, Any]:
        return {
            "client": client_id,
            "version": agent.version,
            "rounds_trained": len(agent.log.rounds_trained),
            "uploads": len(agent.log.uploads),
        }

    with serving(metrics_endpoint(service.metrics_port, live, lambda: agent.connected), service.metrics_port):
        agent.run()
    if agent.finished:
        typer.echo(f"job {service.job} finished: agent {client_id} left", err=True)


def _hosted_clients(
    population: int,
    host: str | None,
    clients: str | None,
    from_hostname: bool,
    hosts: int | None,
    client_id: str | None,
    client_id_from_hostname: bool,
    index: int | None,
) -> tuple[str, list[tuple[int, int]]] | None:
    """`agent run`'s host and the client numbers it serves ([start, stop) ranges), or None for a one-client
    agent; each wrong combination or value is one line."""
    import socket

    from fedmq.broker.transport import topology

    if host is None and not from_hostname:
        if hosts is not None:
            raise UsageError("--hosts N goes with --host-from-hostname")
        if clients is not None:
            raise UsageError("--clients are a host's client numbers: give --host too")
        return None
    given = "--host" if host is not None else "--host-from-hostname"
    if host is not None and from_hostname:
        raise UsageError("give --host or --host-from-hostname, not both")
    if client_id or client_id_from_hostname:
        one = "--client-id" if client_id else "--client-id-from-hostname"
        raise UsageError(f"{given} serves many clients, {one} one: give one or the other")
    if index is not None:
        raise UsageError(f"--index is a one-client agent's: {given}'s client HOST-<n> trains on shard n")
    if population < 1:
        raise UsageError(f"the job's population (clients in --config) must be at least 1, got {population}")
    if from_hostname:
        if clients is not None:
            raise UsageError("--host-from-hostname splits the population: give --hosts N, not --clients")
        if hosts is None:
            raise UsageError("--host-from-hostname needs --hosts N (the StatefulSet's replicas)")
        if not 1 <= hosts <= population:
            raise UsageError(f"--hosts {hosts} must be between 1 and the job's population ({population})")
        hostname = socket.gethostname()
        tail = hostname.rsplit("-", 1)[-1]
        if not tail.isdigit():
            raise UsageError(f"hostname {hostname!r} does not end in a pod ordinal (-N)")
        return _host_share(int(tail), hosts, population)
    assert host is not None
    try:
        topology.check_host(host)
    except ValueError as exc:
        raise UsageError(f"--host: {exc}") from None
    if hosts is not None:
        raise UsageError("--hosts N goes with --host-from-hostname, not --host")
    if clients is None:
        raise UsageError(f"--host {host} needs --clients: the client numbers it serves, e.g. 0-99")
    try:
        ranges = topology.parse_clients(clients)
    except ValueError as exc:
        raise UsageError(f"--clients: {exc}") from None
    if ranges[-1][1] > population:
        raise UsageError(
            f"--clients {clients}: client {ranges[-1][1] - 1} is past the job's population of {population} "
            "(clients in --config): the aggregator would refuse this host's roster"
        )
    return host, ranges


def _host_share(ordinal: int, hosts: int, population: int) -> tuple[str, list[tuple[int, int]]]:
    """Host ``h<ordinal>`` of ``hosts`` and its equal part of the population (parts differ by at most one)."""
    from fedmq.broker.transport.provision import HOST_PREFIX

    if ordinal >= hosts:
        raise UsageError(
            f"pod ordinal {ordinal} is past --hosts {hosts}: the hosts are ordinals 0 to {hosts - 1}"
        )
    return f"{HOST_PREFIX}{ordinal}", [(ordinal * population // hosts, (ordinal + 1) * population // hosts)]


def _run_host(
    service: _Service,
    host_id: str,
    ranges: list[tuple[int, int]],
    task_opts: dict[str, Any],
    *,
    trainers: int,
    client_state: Path | None,
) -> None:
    """`agent run --host`: a Host (client_agent/host.py) built and stopped as the one-client agent is."""
    connect = service.connector()
    host = None
    stop_agent_on_signals(lambda: host, service.stop_grace, hosted=True)
    prepare_process()
    from fedmq.client_agent.host import Host
    from fedmq.client_agent.state import DiskStore
    from fedmq.client_agent.trainers import TrainerPool

    task_obj = make_task(task_opts)
    host = Host(
        connect,
        service.job,
        host_id,
        ranges,
        task_obj,
        **service.client_args(),
        trainers=TrainerPool(task_obj, trainers, service.seed),
        store=DiskStore(client_state) if client_state is not None else None,
    )

    def live() -> dict[str, Any]:
        logs = list(host.logs.values())
        return {
            "host": host_id,
            "clients": host.count(),
            "rounds_trained": sum(len(log.rounds_trained) for log in logs),
            "uploads": sum(len(log.uploads) for log in logs),
        }

    try:
        with serving(
            metrics_endpoint(service.metrics_port, live, lambda: host.connected), service.metrics_port
        ):
            host.run()
    finally:
        # nothing may be left inside torch when the process exits (a running client's thread is a daemon)
        host.trainers.close()
        host.trainers.wait_idle(5.0)
    if host.finished:
        typer.echo(f"job {service.job} finished: host {host_id} left ({host.count()} clients)", err=True)
