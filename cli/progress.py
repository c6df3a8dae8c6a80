"""Round progress bar and the end-of-run summary table (rich), for humans at a terminal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RoundProgress:
    def __init__(self, rounds: int, metric: str, enabled: bool) -> None:
        self.enabled = enabled
        self.metric = metric
        self.console = Console(stderr=True)
        # a short bar leaves room at 80 columns for "10/10 0:01:23 perplexity 123.45" (tests/integration/
        # test_terminal.py)
        self._progress = Progress(
            TextColumn("[bold]{task.fields[label]}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=self.console,
            disable=not enabled,
        )
        self._task = self._progress.add_task("", total=rounds, label="rounds")
        self._local = None  # a second bar for the local training that is running now

    def local(self, client: str, done: int, total: int) -> None:
        """Called from agent threads during local training (rich's Progress is thread-safe)."""
        if not self.enabled:
            return
        if self._local is None:
            self._local = self._progress.add_task("", total=total, label="local")
        self._progress.update(self._local, completed=done, total=total, description=f"{client} training")

    def __enter__(self) -> RoundProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def update(self, row: dict[str, Any]) -> None:
        valid = row.get("valid")
        text = (
            "skipped" if row.get("skipped") else (f"{self.metric} {valid:.2f}" if valid is not None else "")
        )
        self._progress.update(self._task, completed=row["round"], description=text)

    def print_summary(self, summary: dict[str, Any], run_dir: Path) -> None:
        from fedmq.aggregator.runlog import read_rounds
        from fedmq.cli.status import render_summary

        self.console.print(render_summary(summary, [r.to_json() for r in read_rounds(run_dir).records]))
        self.console.print(f"run folder: {run_dir}")
        self.console.print(f"plots:      fedmq report {run_dir}")
