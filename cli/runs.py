"""Run folders as the report shows them: :class:`RunData`, read and validated by aggregator.runlog.read_run.

Loading validates everything, so a bad run folder raises one :class:`ReportError`. Malformed lines in
metrics.jsonl are skipped and counted (a run killed mid-write leaves a torn last line),
never fatal on their own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from fedmq.aggregator.records import CLIENT_LISTS, RoundRecord
from fedmq.aggregator.runlog import RunFolderError, read_run
from fedmq.errors import FedmqError

log = structlog.get_logger(__name__)

# Metrics where a larger value is better; everything else (perplexity, loss) is lower-is-better.
HIGHER_IS_BETTER = {"bleu", "accuracy", "acc", "chrf", "f1"}


class ReportError(FedmqError):
    """A run folder or the output folder cannot be used for a report; the message is one line."""


@dataclass
class RunData:
    """One run folder, loaded and validated. ``rows``: the last record of each round, by round."""

    path: Path
    name: str
    config: dict[str, Any]
    rows: list[RoundRecord]
    summary: dict[str, Any] | None
    malformed_lines: int = 0
    duplicate_rounds: int = 0

    @property
    def complete(self) -> bool:
        """A run is complete once the aggregator wrote summary.json."""
        return self.summary is not None

    @property
    def strategy(self) -> str:
        for source in (self.config, self.summary or {}):
            if isinstance(source.get("strategy"), str):
                return source["strategy"]
        used = [r.strategy for r in self.rows if r.strategy]
        return used[0] if used else "?"

    @property
    def metric(self) -> str:
        if self.summary and isinstance(self.summary.get("metric"), str):
            return self.summary["metric"]
        used = [r.metric for r in self.rows if r.metric]
        return used[-1] if used else "metric"

    @property
    def higher_is_better(self) -> bool:
        if self.summary and isinstance(self.summary.get("higher_is_better"), bool):
            return self.summary["higher_is_better"]
        return self.metric.lower() in HIGHER_IS_BETTER

    @property
    def label(self) -> str:
        """Legend text: run folder name and strategy."""
        return f"{self.name} ({self.strategy})"

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", self.name).strip("-.") or "run"

    def clients(self) -> list[str]:
        """Every client id seen in any row, in natural order (agent-2 before agent-10)."""
        seen: set[str] = set()
        for row in self.rows:
            for key in CLIENT_LISTS:
                seen.update(getattr(row, key))
            seen.update(row.weights)
        return sorted(seen, key=_natural_key)


def _natural_key(text: str) -> list[Any]:
    return [
        (0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text) if part
    ]


def load_run(run_dir: Path | str, name: str | None = None) -> RunData:
    """Load and validate one run folder (aggregator.runlog.read_run);
    raises :class:`ReportError` with one line if it is unusable."""
    try:
        folder = read_run(run_dir)
    except RunFolderError as exc:
        raise ReportError(str(exc)) from None
    run = RunData(
        path=folder.path,
        name=name or folder.path.resolve().name,
        config=folder.config,
        rows=folder.rounds,
        summary=folder.summary,
        malformed_lines=folder.malformed_lines,
        duplicate_rounds=folder.duplicate_rounds,
    )
    log.debug(
        "run loaded",
        run=str(folder.path),
        rounds=len(run.rows),
        malformed=run.malformed_lines,
        complete=run.complete,
    )
    return run


def load_runs(run_dirs: list[Path] | list[str]) -> list[RunData]:
    """Load several run folders; display names are folder names, made unique with their parent if needed."""
    if not run_dirs:
        raise ReportError("no run folder given")
    paths = [Path(p) for p in run_dirs]
    base_names = [p.resolve().name for p in paths]
    names = [
        f"{p.resolve().parent.name}/{n}" if base_names.count(n) > 1 else n for p, n in zip(paths, base_names)
    ]
    seen: set[str] = set()
    for i, name in enumerate(names):  # same folder given twice: suffix, never silently merge
        base, k = name, 2
        while names[i] in seen:
            names[i] = f"{base}#{k}"
            k += 1
        seen.add(names[i])
    return [load_run(p, n) for p, n in zip(paths, names)]


# ---------------------------------------------------------------------------------------------- scores
