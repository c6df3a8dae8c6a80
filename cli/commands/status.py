"""`fedmq status`: a job seen from outside."""

from __future__ import annotations

from pathlib import Path

import typer

from fedmq.cli import options


def status(
    broker: str = options.ADMIN_BROKER,
    job: str = options.JOB_ID,
    run_dir: Path | None = typer.Option(None, help="the aggregator's run folder, for round and metrics"),
    as_json: bool = options.AS_JSON,
) -> None:
    """The job seen from outside: round, agents, last metrics, queue depths, standby aggregator.

    Example: fedmq status --job wt2 --run-dir /var/lib/fedmq
    """
    from fedmq.cli.status_info import gather

    info = gather(broker, job, run_dir)
    from fedmq.cli import status as status_view

    typer.echo(status_view.status_json(info) if as_json else status_view.render_status(info))
