"""`fedmq broker`: the broker's topology, users and permissions for a job."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from fedmq.cli import options
from fedmq.cli.errors import UsageError
from fedmq.cli.help import HelpCommand, HelpGroup

app = typer.Typer(cls=HelpGroup, no_args_is_help=True, help="Broker topology, users and permissions.")


@app.command("provision", cls=HelpCommand)
def broker_provision(
    broker: str = options.ADMIN_BROKER,
    vhost: str = typer.Option("fedmq", help="virtual host to create"),
    job: str = options.JOB_ID,
    agents: int = typer.Option(0, help="number of one-client agents (users agent-0 to agent-N-1)"),
    hosts: str | None = typer.Option(
        None,
        help="hosts, each serving many clients: N (hosts h0 to hN-1, as agent run --host-from-hostname "
        "names them) or ids, comma separated; one user <job>.host.<id> each",
    ),
    secrets_out: str | None = typer.Option(
        None, help="write Kubernetes Secret manifests to DIR, or - for stdout"
    ),
    credentials_out: Path | None = typer.Option(None, help="write a JSON credentials file"),
    namespace: str = typer.Option("fedmq", help="namespace of the Secrets"),
    remove_guest: bool = typer.Option(False, help="delete the guest user (production)"),
) -> None:
    """Create (idempotently) the vhost, the aggregator user and one user per agent and per host with
    least-privilege permissions.

    Example: fedmq broker provision --job wt2 --agents 10 --secrets-out - | kubectl apply -f -

    Example: fedmq broker provision --job wt2 --hosts 4 --credentials-out wt2.json
    """
    from fedmq.broker.transport import provision

    host_ids = _host_ids(hosts)
    provision.provision_cli(
        broker=broker,
        vhost=vhost,
        job=job,
        agents=agents,
        secrets_out=secrets_out,
        credentials_out=credentials_out,
        namespace=namespace,
        remove_guest=remove_guest,
        hosts=host_ids,
    )
    # what was set up, on stderr when stdout carries the Secrets (| kubectl apply -f -)
    for line in _provisioned(vhost, job, agents, host_ids, credentials_out, secrets_out, remove_guest):
        typer.echo(line, err=secrets_out == "-")


def _host_ids(spec: str | None) -> list[str]:
    """``--hosts`` of `broker provision` and `broker purge` (provision.host_ids), or none."""
    from fedmq.broker.transport.provision import host_ids

    try:
        return host_ids(spec) if spec is not None else []
    except ValueError as exc:
        raise UsageError(f"--hosts: {exc}") from None


def _provisioned(
    vhost: str,
    job: str,
    agents: int,
    hosts: list[str],
    credentials_out: Path | None,
    secrets_out: str | None,
    remove_guest: bool,
) -> list[str]:
    """`broker provision`'s summary: the vhost, the users with their permissions, where the passwords went."""
    from fedmq.broker.transport import topology

    lines = [
        f"vhost {vhost}: ready",
        f"user {topology.aggregator_user(job)}: aggregator of job {job}, permissions on the job's queues",
    ]
    if agents:
        first, last = (topology.agent_user(job, f"agent-{i}") for i in (0, agents - 1))
        lines.append(
            f"users {first if agents == 1 else f'{first} … {last}'}: {agents} agent(s) of job {job}, "
            "each confined to its own queues"
        )
    if hosts:
        first, last = (topology.host_user(job, h) for h in (hosts[0], hosts[-1]))
        lines.append(
            f"users {first if len(hosts) == 1 else f'{first} … {last}'}: {len(hosts)} host(s) of job {job}, "
            "each confined to its own queues and its own clients <host>-<n>"
        )
    if remove_guest:
        lines.append("user guest: deleted")
    saved = [str(p) for p in (credentials_out, secrets_out if secrets_out != "-" else None) if p]
    if saved:
        lines.append(f"passwords: in {' and '.join(saved)} (readable by you only)")
    elif secrets_out == "-":
        lines.append("passwords: in the Secrets on stdout")
    else:
        lines.append(
            "passwords: not saved (pass --credentials-out FILE or --secrets-out; rerunning rotates them)"
        )
    return lines


@app.command("deprovision", cls=HelpCommand)
def broker_deprovision(
    broker: str = typer.Option(
        options.LOCAL_BROKER,
        envvar="FEDMQ_BROKER",
        help="an administrator's URL (rabbitmqctl on this machine, else the management API)",
    ),
    vhost: str = typer.Option("fedmq", help="the virtual host the job was provisioned in"),
    job: str = typer.Option(..., envvar="FEDMQ_JOB", help="job id"),
) -> None:
    """Undo provision for one job: delete its users, its queues and the vhost (only one provision created,
    and kept while anything else, another job's or application's, is there). Running it again does nothing.

    Example: fedmq broker deprovision --job wt2 --vhost fedmq
    """
    from fedmq.broker.transport.deprovision import deprovision

    typer.echo(deprovision(broker, vhost=vhost, job=job).line())


@app.command("check", cls=HelpCommand)
def broker_check(
    broker: str = options.ADMIN_BROKER,
    job: str | None = typer.Option(None, envvar="FEDMQ_JOB"),
    as_json: bool = options.AS_JSON,
) -> None:
    """Is the broker reachable? Its version, max message size and the job's queue depths.

    Example: fedmq broker check --job wt2
    """
    from fedmq.broker.transport import provision

    info = provision.check(broker, job)
    typer.echo(json.dumps(info, default=str) if as_json else "\n".join(f"{k}: {v}" for k, v in info.items()))


@app.command("purge", cls=HelpCommand)
def broker_purge(
    broker: str = options.ADMIN_BROKER,
    job: str = options.JOB_ID,
    agents: int = typer.Option(0, help="also the queues of agents agent-0 to agent-N-1"),
    hosts: str | None = typer.Option(
        None, help="also the queues of these hosts: N (h0 to hN-1) or ids, comma separated"
    ),
    edges: int = typer.Option(0, help="also the queues of edge aggregators e0 to eN-1"),
) -> None:
    """Delete the job's queues. Through rabbitmqctl (a broker on this machine) every queue of the job; else
    the inbox, the model stream and the queues of the agents, hosts and edges named.

    Example: fedmq broker purge --job wt2 --hosts 4
    """
    from fedmq.broker.transport import provision

    if agents < 0 or edges < 0:
        raise UsageError(f"--agents and --edges must be at least 0, got {agents} and {edges}")
    provision.purge(broker, job, [*(f"agent-{i}" for i in range(agents)), *_host_ids(hosts)], edges)
    typer.echo(f"purged job {job}")
