"""`fedmq report`: plots and tables of runs."""

from __future__ import annotations

from pathlib import Path

import typer


def report(
    run_dirs: list[Path] = typer.Argument(..., help="one or more run folders"),
    out: Path | None = typer.Option(None, help="output folder (default: RUN_DIR/report)"),
) -> None:
    """Plots and tables of one or several runs: PNG files, one self-contained HTML page, a markdown table.

    Example: fedmq report runs/fedavg runs/fedatt --out runs/compare
    """
    from fedmq.cli.report import run_report

    typer.echo(run_report(list(run_dirs), out).describe())
