"""`fedmq aggregator`: the aggregator service."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from fedmq.aggregator.config import STRATEGIES
from fedmq.cli import options
from fedmq.cli.errors import check_progress
from fedmq.cli.help import HelpCommand, HelpGroup
from fedmq.cli.process import make_task, prepare_process, setup_logs
from fedmq.cli.services import broker_url, job_file, merge, metrics_endpoint, serving
from fedmq.cli.signals import stop_on_signals

app = typer.Typer(cls=HelpGroup, no_args_is_help=True, help="The aggregator service.")


@app.command("run", cls=HelpCommand)
def aggregator_run(
    broker: str = options.SERVICE_BROKER,
    job: str | None = typer.Option(None, envvar="FEDMQ_JOB", help="job id"),
    config: Path | None = typer.Option(None, envvar="FEDMQ_CONFIG", help="TOML file: job keys, [task] table"),
    state_dir: Path = typer.Option(
        Path("fedmq-state"), envvar="FEDMQ_STATE_DIR", help="run folder: checkpoints, metrics"
    ),
    strategy: str | None = typer.Option(
        None, envvar="FEDMQ_STRATEGY", help=", ".join(STRATEGIES) + " or package.module:Class"
    ),
    rounds: int | None = typer.Option(
        None, envvar="FEDMQ_ROUNDS", help="communication rounds (async: global versions)"
    ),
    clients: int | None = typer.Option(None, envvar="FEDMQ_CLIENTS", help="K: the agents of the job"),
    fraction: float | None = typer.Option(
        None, envvar="FEDMQ_FRACTION", help="C: the share of online agents selected each round"
    ),
    strategy_arg: list[str] | None = typer.Option(
        None,
        "--strategy-arg",
        metavar="KEY=VALUE",
        help="a parameter of the strategy, repeatable: --strategy-arg mu=0.01 "
        "(overrides the [strategy] table)",
    ),
    user: str | None = options.BROKER_USER,
    password: str | None = options.BROKER_PASSWORD,
    metrics_port: int = options.METRICS_PORT,
    chunk_limit: int = options.CHUNK_LIMIT,
    heartbeat: int = options.HEARTBEAT,
    consume_timeout: float = options.CONSUME_TIMEOUT,
    log_format: str = options.LOG_FORMAT,
    log_level: str = options.LOG_LEVEL,
    tier: str = typer.Option(
        "root",
        envvar="FEDMQ_TIER",
        help="root: the job's aggregator; edge: folds the updates of the clients routed to it into partial "
        "sums for the root (two-tier aggregation, needs --edge)",
    ),
    edge: int | None = typer.Option(None, envvar="FEDMQ_EDGE", help="--tier edge: which edge, 0 to edges-1"),
    edges: int | None = typer.Option(
        None, envvar="FEDMQ_EDGES", help="the job's edge aggregators (two-tier aggregation; 0: none)"
    ),
    secagg: bool | None = typer.Option(
        None,
        "--secagg/--no-secagg",
        envvar="FEDMQ_SECAGG",
        help="secure aggregation: learn only the sum of a round's updates (secagg_* keys in --config)",
    ),
    print_config: bool = typer.Option(False, help="print the resolved, validated config as JSON and exit"),
) -> None:
    """Run the aggregator service until the job's rounds are done (resumes from --state-dir).

    Precedence: flags > FEDMQ_* environment variables > the --config file > defaults.

    Example: fedmq aggregator run --broker amqps://rabbit:5671/fedmq --job wt2 --config job.toml
    --state-dir /var/lib/fedmq
    """
    from fedmq.aggregator.config import JobConfig
    from fedmq.params import parse_assignments

    jobfile = job_file(config)  # a job file or flag that is wrong: one line, before torch is loaded
    values, task_opts = dict(jobfile.job), {"task": "lm", "data": "builtin", **jobfile.task}
    if strategy_arg:
        values["strategy_args"] = {**values.get("strategy_args", {}), **parse_assignments(strategy_arg)}
    cfg = JobConfig.from_dict(
        merge(
            values,
            {
                "job": job,
                "strategy": strategy,
                "rounds": rounds,
                "clients": clients,
                "fraction": fraction,
                "edges": edges,
                "secagg": secagg,
            },
        )
    )
    check_tier(tier, edge, cfg.edges)
    task_opts.setdefault("clients", cfg.clients)
    if print_config:
        typer.echo(json.dumps({**cfg.to_dict(), "task": task_opts}, sort_keys=True))
        return
    log_name = "aggregator" if tier == "root" else f"edge-{edge}"
    setup_logs(log_level, log_format, state_dir / "logs" / f"{log_name}.jsonl")
    prepare_process()
    from fedmq.aggregator.engine import Engine
    from fedmq.broker.transport.connect import connect

    engine: Any = None
    stop_on_signals(lambda: engine, lambda e: e.started)
    task_obj = make_task(task_opts)
    # a chunked update whose sender went silent this long (it died mid-upload) is dropped and its chunks
    # rejected; generous, because a publisher blocked by flow control is silent too and its update must still
    # complete
    conn = connect(
        broker_url(broker, user, password),
        chunk_limit=chunk_limit,
        heartbeat=heartbeat,
        consume_timeout=consume_timeout,
        chunk_timeout_s=max(cfg.update_deadline_s, 300.0),
    )
    from fedmq.broker.transport import topology

    if tier == "edge":
        assert edge is not None
        run_edge(conn, task_obj, cfg, edge, state_dir)
        return

    def live_status() -> dict[str, Any]:
        inbox = topology.q_inbox(cfg.job)
        return {
            **engine.status(),
            "broker": conn.status(),
            "queue_depths": {inbox: conn.queue_depth(inbox)},
        }

    telemetry = metrics_endpoint(metrics_port, live_status, lambda: bool(conn.status().get("connected")))
    engine = Engine(conn, task_obj, cfg, state_dir, on_round=telemetry.observe_round if telemetry else None)
    with serving(telemetry, metrics_port):
        try:
            summary = engine.run()
        finally:
            conn.close()
    typer.echo(json.dumps(summary, default=str))
    check_progress(summary)


def check_tier(tier: str, edge: int | None, edges: int) -> None:
    """--tier and --edge against the job's edges, in one line (exit 2)."""
    from fedmq.errors import BadParameter

    if tier not in ("root", "edge"):
        raise BadParameter(f"--tier {tier!r}: use root or edge")
    if tier == "root" and edge is not None:
        raise BadParameter("--edge is for --tier edge")
    if tier == "edge" and not edges:
        raise BadParameter(
            "--tier edge: the job has no edge aggregators (edges = N in the job file, or --edges N)"
        )
    if tier == "edge" and (edge is None or not 0 <= edge < edges):
        raise BadParameter(f"--tier edge needs --edge in [0, {edges}) (the job's edges = {edges})")


def run_edge(conn: Any, task: Any, cfg: Any, index: int, state_dir: Path) -> None:
    """`--tier edge`: fold the updates routed to edge ``index`` until the job ends or a signal stops it."""
    from fedmq.aggregator.edge import Edge

    service: Edge | None = None
    stop_on_signals(lambda: service, lambda e: e.started)
    service = Edge(conn, task, cfg, index, state_dir)
    try:
        partials = service.run()
    finally:
        conn.close()
    typer.echo(json.dumps({"edge": service.name, "partials": partials, "job_ended": service.ended}))
