"""The run folder: the only module that reads or writes its files (their names are spelled here alone).

A run folder holds the resolved config (``config.json``), one :class:`~aggregator.records.RoundRecord` per
round (``metrics.jsonl``), the final summary (``summary.json``) and the live status (``status.json``). Each
round's record is written three ways: ``metrics.jsonl`` (the record every fedmq command reads),
``metrics.csv`` (the same rows, one per round, columns in ``CSV_COLUMNS`` order) and TensorBoard event files
under ``tb/`` (scalars per round: score, loss, bytes, participation, aggregation weights). The CSV is always
rewritten from the JSON lines when they change under it (resume), so the two never disagree.

Reading is tolerant where a run may be caught mid-write: a malformed or torn line of metrics.jsonl is skipped
and counted (:func:`read_rounds`), never fatal on its own. :func:`read_run` validates a whole folder for the
report and the benchmarks and raises :class:`RunFolderError` with one line when it is unusable.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from fedmq.aggregator.records import CLIENT_LISTS, MalformedRow, RoundRecord
from fedmq.errors import FedmqError
from fedmq.files import private_folder, replacing, write_atomic

log = structlog.get_logger(__name__)

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
CSV_FILE = "metrics.csv"
SUMMARY_FILE = "summary.json"
STATUS_FILE = "status.json"
BOARD_DIR = "tb"
RUN_FILES = (CONFIG_FILE, METRICS_FILE)  # either one means the folder holds a run

# the record's keys, scalars first; any other key goes to "extra" as JSON
CSV_COLUMNS = (
    "round",
    "time",
    "version",
    "strategy",
    "metric",
    "valid",
    "mean_loss",
    "skipped",
    "skip_reason",
    "wall_s",
    "epsilon",
    "delta",
    "bytes_up",
    "bytes_down",
    "bytes_up_raw",
    "bytes_down_raw",
    "online",
    "selected",
    "reported",
    "granted",
    "received",
    "dropped",
    "losses",
    "weights",
    "update_ids",
    "rejected",
    "dropped_msgs",
    "extra",
)


class RunFolderError(FedmqError):
    """A run folder cannot be read; the message is one line."""


@dataclass(frozen=True)
class Rounds:
    """The round records of metrics.jsonl in file order, and how many lines were not records."""

    records: tuple[RoundRecord, ...]
    malformed: int

    def latest(self) -> tuple[list[RoundRecord], int]:
        """The last record of each round, by round, and how many earlier ones they replace (a resumed run
        re-logs the rounds after its checkpoint: the last one wins)."""
        by_round = {r.round: r for r in self.records}
        return [by_round[r] for r in sorted(by_round)], len(self.records) - len(by_round)


@dataclass(frozen=True)
class RunFolder:
    """A run folder read back and validated (:func:`read_run`)."""

    path: Path
    config: dict[str, Any]  # empty without config.json
    rounds: list[RoundRecord]  # the last record of each round, by round; never empty
    summary: dict[str, Any] | None  # None until the run finished
    malformed_lines: int
    duplicate_rounds: int


def _lines(run_dir: Path) -> list[tuple[str, RoundRecord | None]]:
    """Each non-blank line of metrics.jsonl with its record (None: malformed or torn); no file: none."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        raise RunFolderError(f"cannot read {path}: {exc.strerror or exc}") from None
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            out.append((line, RoundRecord.from_json(json.loads(line))))
        except (json.JSONDecodeError, MalformedRow, RecursionError):
            out.append((line, None))
    return out


def read_rounds(run_dir: Path) -> Rounds:
    """The round records of ``run_dir``'s metrics.jsonl (none without one); see the module docstring."""
    lines = _lines(run_dir)
    records = tuple(r for _, r in lines if r is not None)
    return Rounds(records, len(lines) - len(records))


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of a run folder; :class:`RunFolderError` with one line if it is not one (its
    ``__cause__``: the error that made the file unreadable, None when it holds JSON that is no object)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise RunFolderError(f"{path} is not UTF-8 text") from exc
    except json.JSONDecodeError as exc:
        raise RunFolderError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg})") from exc
    except OSError as exc:
        raise RunFolderError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if not isinstance(data, dict):
        raise RunFolderError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def read_config(run_dir: Path) -> dict[str, Any] | None:
    """The run's config.json (None without one)."""
    path = Path(run_dir) / CONFIG_FILE
    return _read_json(path) if path.is_file() else None


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """The run's summary.json (None until the run finished)."""
    path = Path(run_dir) / SUMMARY_FILE
    return _read_json(path) if path.is_file() else None


def finished(run_dir: Path) -> bool:
    """The run wrote its summary.json."""
    return (Path(run_dir) / SUMMARY_FILE).is_file()


def read_status(run_dir: Path) -> dict[str, Any]:
    """The live status the active aggregator keeps (empty when missing or unreadable:
    it is rewritten often)."""
    try:
        return _read_json(Path(run_dir) / STATUS_FILE)
    except RunFolderError:
        return {}


def holds_run(run_dir: Path) -> list[str]:
    """The files of ``RUN_FILES`` that ``run_dir`` holds."""
    return [name for name in RUN_FILES if (Path(run_dir) / name).exists()]


def read_run(run_dir: Path | str) -> RunFolder:
    """Read and validate one run folder; :class:`RunFolderError` with one line if it is unusable."""
    path = Path(run_dir)
    if not path.exists():
        raise RunFolderError(f"run folder not found: {path}")
    if not path.is_dir():
        raise RunFolderError(f"not a fedmq run folder: {path} is not a folder")
    metrics = path / METRICS_FILE
    if not metrics.is_file():
        raise RunFolderError(f"not a fedmq run folder: {path} has no {METRICS_FILE}")
    config = read_config(path) or {}
    summary = read_summary(path)
    rounds = read_rounds(path)
    latest, duplicates = rounds.latest()
    if not latest:
        detail = f" ({rounds.malformed} malformed line(s))" if rounds.malformed else ""
        raise RunFolderError(f"{metrics} has no valid round rows yet{detail}")
    return RunFolder(
        path=path,
        config=config,
        rounds=latest,
        summary=summary,
        malformed_lines=rounds.malformed,
        duplicate_rounds=duplicates,
    )


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """Replace the run's summary.json (the benchmarks add their own fields to the engine's)."""
    _write_json(Path(run_dir) / SUMMARY_FILE, summary)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str))


def csv_cells(row: dict[str, Any]) -> list[str]:
    """A row (a record's JSON) as CSV cells: strings as they are, None empty, everything else as JSON."""
    extra = {k: v for k, v in row.items() if k not in CSV_COLUMNS}
    values = {**row, "extra": extra or None}
    return [_cell(values.get(name)) for name in CSV_COLUMNS]


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def board_scalars(record: RoundRecord) -> dict[str, float]:
    """A record's TensorBoard scalars, tag -> value (the validation score is tagged by its metric)."""
    out: dict[str, float] = {}
    if record.valid is not None:
        out[f"valid/{record.metric or 'score'}"] = float(record.valid)
    if record.mean_loss is not None:
        out["train/mean_loss"] = float(record.mean_loss)
    for key in ("bytes_up", "bytes_down", "bytes_up_raw", "bytes_down_raw"):
        out[f"bytes/{key[len('bytes_') :]}"] = float(getattr(record, key) or 0)
    for key in CLIENT_LISTS:  # participation: how many clients each
        out[f"participation/{key}"] = float(len(getattr(record, key)))
    out["participation/skipped"] = float(record.skipped)
    out["round/wall_s"] = float(record.wall_s or 0)
    if record.epsilon is not None:
        out["privacy/epsilon"] = float(record.epsilon)
    for client, weight in sorted(record.weights.items()):
        out[f"weights/{client}"] = float(weight)
    return out


class RunLog:
    """The writer of one run folder (the engine's)."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = private_folder(run_dir)
        self.metrics_path = self.dir / METRICS_FILE
        self.csv_path = self.dir / CSV_FILE
        self.tb_dir = self.dir / BOARD_DIR
        self._csv_checked = False  # this process checked the CSV's header (or rewrote the file) once
        self._writer: Any = None
        self._no_board = False  # tensorboard is not installed: warned once, CSV and JSON lines still written
        self._purge_step: int | None = None

    def write_config(self, config: dict[str, Any]) -> None:
        _write_json(self.dir / CONFIG_FILE, config)

    def append(self, row: RoundRecord | Mapping[str, Any]) -> None:
        """Append a round: its record, or the record's JSON (the engine's row, checked here:
        :class:`MalformedRow` if it would not read back)."""
        record = row if isinstance(row, RoundRecord) else RoundRecord.from_json(dict(row))
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(record.to_json(), sort_keys=True) + "\n")
            fh.flush()
        self._append_csv(record)
        self._board_rows([record])

    def rows(self) -> list[RoundRecord]:
        """The records written so far, in file order (see :func:`read_rounds`)."""
        return list(read_rounds(self.dir).records)

    def truncate_after(self, rnd: int) -> None:
        """On resume, forget rows of rounds the checkpoint does not include (they will be run again); the rows
        kept stay byte for byte, malformed lines go.

        TensorBoard's rows of those rounds are hidden by a purge from ``rnd + 1`` on (TensorBoard drops the
        steps a restarted writer declares purged); a run folder without event files gets its kept rows in new
        ones."""
        kept = [(line, r) for line, r in _lines(self.dir) if r is not None and r.round <= rnd]
        write_atomic(self.metrics_path, "".join(line + "\n" for line, _ in kept))
        records = [r for _, r in kept]
        self._write_csv(records)
        self.close()
        if any(self.tb_dir.glob("events.out.tfevents.*")):
            self._purge_step = rnd + 1
        else:
            self._board_rows(records)

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_summary(self.dir, summary)
        self.close()

    def close(self) -> None:
        """Close the TensorBoard writer (the run ended); a later ``append`` opens a new event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _append_csv(self, record: RoundRecord) -> None:
        if not self._csv_checked:
            # once per process: a CSV that is missing, has other columns or lacks a row (a folder from before
            # the CSV, a kill between the two writes) is rebuilt from the JSON lines,
            # which already hold ``record``
            records = self.rows()
            table = []
            if self.csv_path.is_file():
                with open(self.csv_path, newline="") as fh:
                    table = list(csv.reader(fh))
            if table[:1] != [list(CSV_COLUMNS)] or len(table) != len(
                records
            ):  # header + the rows before ``record``
                self._write_csv(records)
                return
            self._csv_checked = True
        with open(self.csv_path, "a", newline="") as fh:
            csv.writer(fh).writerow(csv_cells(record.to_json()))

    def _write_csv(self, records: list[RoundRecord]) -> None:
        with replacing(self.csv_path, text=True) as fh:
            writer = csv.writer(fh)
            writer.writerow(CSV_COLUMNS)
            writer.writerows(csv_cells(r.to_json()) for r in records)
        self._csv_checked = True

    def _board_rows(self, records: list[RoundRecord]) -> None:
        if not records or self._board() is None:
            return
        for record in records:
            step, walltime = record.round, record.time
            for tag, value in board_scalars(record).items():
                self._writer.add_scalar(tag, value, step, walltime=walltime)
            if record.weights:
                import numpy as np

                weights = np.asarray(list(record.weights.values()), dtype=np.float64)
                self._writer.add_histogram("weights", weights, step, walltime=walltime)
        self._writer.flush()  # a round is rare and a crash must not lose it

    def _board(self) -> Any:
        """The TensorBoard writer, opened on first use (importing it costs a second;
        status and report never do)."""
        if self._writer is None and not self._no_board:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                self._no_board = True
                log.warning("no TensorBoard event files: pip install tensorboard==2.21.0", error=str(exc))
                return None
            self._writer = SummaryWriter(str(self.tb_dir), purge_step=self._purge_step)
            self._purge_step = None
        return self._writer

    def write_status(self, status: dict[str, Any]) -> None:
        """The live status (phase, round, agents online), rewritten as it changes:
        see Engine._write_status."""
        _write_json(self.dir / STATUS_FILE, status)
