"""The run folder: resolved config, one metrics row per round (JSON lines), and the final summary."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


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


class RunLog:
    def __init__(self, run_dir: Path) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"

    def write_config(self, config: dict[str, Any]) -> None:
        self._write_json("config.json", config)

    def append(self, row: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(row, sort_keys=True) + "\n")
            fh.flush()

    def rows(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)

    def truncate_after(self, rnd: int) -> None:
        """On resume, forget rows of rounds the checkpoint does not include (they will be run again)."""
        rows = [r for r in self.rows() if r.get("round", 0) <= rnd]
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        os.replace(tmp, self.metrics_path)

    def write_summary(self, summary: dict[str, Any]) -> None:
        self._write_json("summary.json", summary)

    def _write_json(self, name: str, obj: dict[str, Any]) -> None:
        tmp = self.dir / (name + ".tmp")
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
        os.replace(tmp, self.dir / name)
