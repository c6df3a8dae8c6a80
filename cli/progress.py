"""Round progress bar and the end-of-run summary table (rich), for humans at a terminal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class RoundProgress:
    def __init__(self, rounds: int, metric: str, enabled: bool) -> None:
        self.enabled = enabled
        self.metric = metric
        self.console = Console(stderr=True)
        self._progress = Progress(TextColumn("[bold]rounds"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                  TextColumn("{task.description}"), console=self.console, disable=not enabled)
        self._task = self._progress.add_task("", total=rounds)

    def __enter__(self) -> "RoundProgress":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def update(self, row: dict[str, Any]) -> None:
        valid = row.get("valid")
        text = "skipped" if row.get("skipped") else (f"{self.metric} {valid:.2f}" if valid is not None else "")
        self._progress.update(self._task, completed=row["round"], description=text)

    def print_summary(self, summary: dict[str, Any], run_dir: Path) -> None:
        table = Table(title=f"fedmq run — {run_dir}")
        table.add_column("what")
        table.add_column("value", justify="right")
        metric = summary.get("metric", "score")
        for label, key in ((f"best valid {metric}", "best_valid"), (f"test {metric}", "test"),
                           ("best round", "best_round"), ("rounds completed", "rounds_completed"),
                           ("rounds skipped", "rounds_skipped"), ("bytes up", "bytes_up"),
                           ("bytes down", "bytes_down"), ("wall time (s)", "wall_s")):
            value = summary.get(key)
            table.add_row(label, f"{value:,.2f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else str(value))
        self.console.print(table)
        self.console.print(f"plots: fedmq report {run_dir}")
