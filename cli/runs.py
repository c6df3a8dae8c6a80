"""Run folders read back (config.json, metrics.jsonl, summary.json): :class:`RunData`, loaded and validated.

Loading validates everything, so a bad run folder raises one :class:`ReportError`. Malformed lines in
metrics.jsonl are skipped and counted (a run killed mid-write leaves a torn last line), never fatal on their own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from fedmq.errors import FedmqError

log = structlog.get_logger(__name__)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"

# Metrics where a larger value is better; everything else (perplexity, loss) is lower-is-better.
HIGHER_IS_BETTER = {"bleu", "accuracy", "acc", "chrf", "f1"}
_CLIENT_LISTS = ("online", "selected", "reported", "granted", "received", "dropped")
_NUMBERS = ("valid", "mean_loss", "bytes_up", "bytes_down", "bytes_up_raw", "bytes_down_raw", "wall_s", "time")


class ReportError(FedmqError):
    """A run folder or the output folder cannot be used for a report; the message is one line."""


@dataclass
class RunData:
    """One run folder, loaded and validated. ``rows`` are normalised metrics rows sorted by round."""

    path: Path
    name: str
    config: dict[str, Any]
    rows: list[dict[str, Any]]
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
        used = [r["strategy"] for r in self.rows if r["strategy"]]
        return used[0] if used else "?"

    @property
    def metric(self) -> str:
        if self.summary and isinstance(self.summary.get("metric"), str):
            return self.summary["metric"]
        used = [r["metric"] for r in self.rows if r["metric"]]
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
            for key in _CLIENT_LISTS:
                seen.update(row[key])
            seen.update(row["weights"])
        return sorted(seen, key=_natural_key)


def _natural_key(text: str) -> list[Any]:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text) if part]


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ReportError(f"{path} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def normalize_row(raw: Any) -> dict[str, Any] | None:
    """A metrics row with every field the report reads, typed; None when the row is malformed.

    Missing optional fields get neutral defaults (empty lists, None); present fields of the wrong type
    make the whole row malformed, since a half-trusted row would draw a wrong picture.
    """
    if not isinstance(raw, dict):
        return None
    rnd = raw.get("round")
    if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
        return None
    row: dict[str, Any] = {"round": rnd}
    for key in ("strategy", "metric"):
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            return None
        row[key] = value
    for key in _NUMBERS:
        value = raw.get(key)
        if value is not None and not is_number(value):
            return None
        row[key] = None if value is None else float(value)
    for key in _CLIENT_LISTS:
        value = raw.get(key, [])
        if value is None:
            value = []
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            return None
        row[key] = list(value)
    skipped = raw.get("skipped", False)
    if not isinstance(skipped, bool):
        return None
    row["skipped"] = skipped
    weights = raw.get("weights") or {}
    if not isinstance(weights, dict) or not all(is_number(w) for w in weights.values()):
        return None
    row["weights"] = {str(k): float(w) for k, w in weights.items()}
    rejected = raw.get("rejected") or {}
    if not isinstance(rejected, dict) or not all(is_number(n) for n in rejected.values()):
        return None
    row["rejected"] = {str(k): int(n) for k, n in rejected.items()}
    return row


def load_run(run_dir: Path | str, name: str | None = None) -> RunData:
    """Load and validate one run folder; raises :class:`ReportError` with one line if it is unusable."""
    path = Path(run_dir)
    if not path.exists():
        raise ReportError(f"run folder not found: {path}")
    if not path.is_dir():
        raise ReportError(f"not a fedmq run folder: {path} is not a folder")
    metrics = path / METRICS_FILE
    if not metrics.is_file():
        raise ReportError(f"not a fedmq run folder: {path} has no {METRICS_FILE}")
    config = _read_json_object(path / CONFIG_FILE) if (path / CONFIG_FILE).is_file() else {}
    summary = _read_json_object(path / SUMMARY_FILE) if (path / SUMMARY_FILE).is_file() else None
    try:
        text = metrics.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        raise ReportError(f"cannot read {metrics}: {exc.strerror or exc}") from None

    by_round: dict[int, dict[str, Any]] = {}
    malformed = duplicates = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = normalize_row(json.loads(line))
        except (json.JSONDecodeError, RecursionError):
            row = None
        if row is None:
            malformed += 1
            continue
        if row["round"] in by_round:
            duplicates += 1  # a resumed run re-logs the rounds after its checkpoint: the last one wins
        by_round[row["round"]] = row
    if not by_round:
        detail = f" ({malformed} malformed line(s))" if malformed else ""
        raise ReportError(f"{metrics} has no valid round rows yet{detail}")
    rows = [by_round[r] for r in sorted(by_round)]
    run = RunData(path=path, name=name or path.resolve().name, config=config, rows=rows, summary=summary,
                  malformed_lines=malformed, duplicate_rounds=duplicates)
    log.debug("run loaded", run=str(path), rounds=len(rows), malformed=malformed, complete=run.complete)
    return run


def load_runs(run_dirs: list[Path] | list[str]) -> list[RunData]:
    """Load several run folders; display names are folder names, made unique with their parent if needed."""
    if not run_dirs:
        raise ReportError("no run folder given")
    paths = [Path(p) for p in run_dirs]
    base_names = [p.resolve().name for p in paths]
    names = [f"{p.resolve().parent.name}/{n}" if base_names.count(n) > 1 else n for p, n in zip(paths, base_names)]
    seen: set[str] = set()
    for i, name in enumerate(names):  # same folder given twice: suffix, never silently merge
        base, k = name, 2
        while names[i] in seen:
            names[i] = f"{base}#{k}"
            k += 1
        seen.add(names[i])
    return [load_run(p, n) for p, n in zip(paths, names)]


# ---------------------------------------------------------------------------------------------- scores
