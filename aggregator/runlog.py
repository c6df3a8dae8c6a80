"""The run folder: resolved config, one metrics row per round, and the final summary.

Each round's row is written three ways: ``metrics.jsonl`` (the record every fedmq command reads), ``metrics.csv``
(the same rows, one per round, columns in ``CSV_COLUMNS`` order) and TensorBoard event files under ``tb/``
(scalars per round: score, loss, bytes, participation, aggregation weights). The CSV is always rewritten from the
JSON lines when they change under it (resume), so the two never disagree.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

# the engine's row keys (aggregator.engine.Engine._row), scalars first; any other key goes to "extra" as JSON
CSV_COLUMNS = ("round", "time", "version", "strategy", "metric", "valid", "mean_loss", "skipped", "skip_reason",
               "wall_s", "bytes_up", "bytes_down", "bytes_up_raw", "bytes_down_raw", "online", "selected", "reported",
               "granted", "received", "dropped", "losses", "weights", "update_ids", "rejected", "dropped_msgs", "extra")
# row lists counted as participation scalars in TensorBoard
PARTICIPATION = ("online", "selected", "reported", "granted", "received", "dropped")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file (missing file: none); a malformed or torn line is skipped."""
    if not Path(path).is_file():
        return []
    out = []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def csv_cells(row: dict[str, Any]) -> list[str]:
    """A row as CSV cells: strings as they are, None empty, everything else (numbers, lists, dicts) as JSON."""
    extra = {k: v for k, v in row.items() if k not in CSV_COLUMNS}
    values = {**row, "extra": extra or None}
    return [_cell(values.get(name)) for name in CSV_COLUMNS]


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def board_scalars(row: dict[str, Any]) -> dict[str, float]:
    """A row's TensorBoard scalars, tag -> value (the validation score is tagged by its metric)."""
    out: dict[str, float] = {}
    if row.get("valid") is not None:
        out[f"valid/{row.get('metric') or 'score'}"] = float(row["valid"])
    if row.get("mean_loss") is not None:
        out["train/mean_loss"] = float(row["mean_loss"])
    for key in ("bytes_up", "bytes_down", "bytes_up_raw", "bytes_down_raw"):
        out[f"bytes/{key[len('bytes_'):]}"] = float(row.get(key) or 0)
    for key in PARTICIPATION:
        value = row.get(key) or 0
        out[f"participation/{key}"] = float(len(value) if isinstance(value, (list, dict)) else value)
    out["participation/skipped"] = float(bool(row.get("skipped")))
    out["round/wall_s"] = float(row.get("wall_s") or 0)
    for client, weight in sorted((row.get("weights") or {}).items()):
        out[f"weights/{client}"] = float(weight)
    return out


class RunLog:
    def __init__(self, run_dir: Path) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.csv_path = self.dir / "metrics.csv"
        self.tb_dir = self.dir / "tb"
        self._csv_checked = False  # this process checked the CSV's header (or rewrote the file) once
        self._writer: Any = None
        self._no_board = False  # tensorboard is not installed: warned once, CSV and JSON lines still written
        self._purge_step: int | None = None

    def write_config(self, config: dict[str, Any]) -> None:
        self._write_json("config.json", config)

    def append(self, row: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(row, sort_keys=True) + "\n")
            fh.flush()
        self._append_csv(row)
        self._board_rows([row])

    def rows(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)

    def truncate_after(self, rnd: int) -> None:
        """On resume, forget rows of rounds the checkpoint does not include (they will be run again).

        TensorBoard's rows of those rounds are hidden by a purge from ``rnd + 1`` on (TensorBoard drops the
        steps a restarted writer declares purged); a run folder without event files gets its kept rows in new ones."""
        rows = [r for r in self.rows() if r.get("round", 0) <= rnd]
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        os.replace(tmp, self.metrics_path)
        self._write_csv(rows)
        self.close()
        if any(self.tb_dir.glob("events.out.tfevents.*")):
            self._purge_step = rnd + 1
        else:
            self._board_rows(rows)

    def write_summary(self, summary: dict[str, Any]) -> None:
        self._write_json("summary.json", summary)
        self.close()

    def close(self) -> None:
        """Close the TensorBoard writer (the run ended); a later ``append`` opens a new event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _append_csv(self, row: dict[str, Any]) -> None:
        if not self._csv_checked:
            # once per process: a CSV that is missing, has other columns or lacks a row (a folder from before the
            # CSV, a kill between the two writes) is rebuilt from the JSON lines, which already hold ``row``
            rows = self.rows()
            table = []
            if self.csv_path.is_file():
                with open(self.csv_path, newline="") as fh:
                    table = list(csv.reader(fh))
            if table[:1] != [list(CSV_COLUMNS)] or len(table) != len(rows):  # header + the rows before ``row``
                self._write_csv(rows)
                return
            self._csv_checked = True
        with open(self.csv_path, "a", newline="") as fh:
            csv.writer(fh).writerow(csv_cells(row))

    def _write_csv(self, rows: list[dict[str, Any]]) -> None:
        tmp = self.csv_path.with_suffix(".tmp")
        with open(tmp, "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(CSV_COLUMNS)
            writer.writerows(csv_cells(r) for r in rows)
        os.replace(tmp, self.csv_path)
        self._csv_checked = True

    def _board_rows(self, rows: list[dict[str, Any]]) -> None:
        if not rows or self._board() is None:
            return
        for row in rows:
            step, walltime = int(row.get("round", 0)), row.get("time")
            for tag, value in board_scalars(row).items():
                self._writer.add_scalar(tag, value, step, walltime=walltime)
            weights = list((row.get("weights") or {}).values())
            if weights:
                import numpy as np
                self._writer.add_histogram("weights", np.asarray(weights, dtype=np.float64), step, walltime=walltime)
        self._writer.flush()  # a round is rare and a crash must not lose it

    def _board(self) -> Any:
        """The TensorBoard writer, opened on first use (importing it costs a second; status and report never do)."""
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
        """The live status (phase, round, agents online), rewritten as it changes: see Engine._write_status."""
        self._write_json("status.json", status)

    def _write_json(self, name: str, obj: dict[str, Any]) -> None:
        tmp = self.dir / (name + ".tmp")
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
        os.replace(tmp, self.dir / name)
