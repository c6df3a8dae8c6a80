"""Durable record of the open round, so a killed aggregator resumes it exactly.

An update is acked only after its bytes are in the spool (fsynced for a real broker): a restart replays the
spool of the round that was open, so no confirmed update is lost, and the (round, client) key means none is
counted twice. A report is acked once it is appended to the round's report log (``save_report``): one line,
where rewriting the round's state for each would cost O(m) a report and O(m²) a round of m. The bytes are
kept as they came off the wire, and read back one update at a time: a round's updates are on disk, never all
in memory. The spool of a round is cleared once the checkpoint that includes the round is written. Acking
promptly also keeps every delivery far below RabbitMQ's consumer timeout, whatever the round length.

Clearing keeps the cleared rounds' update files in ``free/``, as many as they had, and the next updates are
written over them (fedmq.files.replacing's ``reuse``): while a round's spool fits in memory their pages stay
in the page cache, where deleting them and writing new files took fresh memory for every update, which costs
more than the copy itself on a VM whose host takes freed memory back (docs/benchmarks.md, "Cohorts"). So a
client's update stays on disk, unread, until a later update is written over it or the run ends
(``drop_free``, called by the process that was active): up to a round longer than before.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

from fedmq.files import append_line, write_atomic

_KEY = re.compile(r"^[A-Za-z0-9_-]{1,80}$")
REPORTS = "reports.jsonl"  # a round's report log: one [client, loss] line a report
FREE = "free"  # deleted rounds' update files, written over by the next updates (module docstring)


class RoundSpool:
    def __init__(self, root: Path, durable: bool = True) -> None:
        self.root = Path(root)
        self.durable = durable
        self._free: list[Path] = []  # files in FREE that no writer has taken yet
        self._free_lock = threading.Lock()  # clear_upto runs in the checkpoint writer's thread

    def _dir(self, rnd: int) -> Path:
        d = self.root / f"r{rnd:06d}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def save_state(self, rnd: int, state: dict[str, Any]) -> None:
        """Round facts decided so far: selected, granted, strategy choice, reports."""
        write_atomic(self._dir(rnd) / "round.json", json.dumps(state).encode(), durable=self.durable)

    def save_online(self, rnd: int, online: list[str]) -> None:
        """Who was online when the round selected (before its first save_state): apart from the round's
        state, which is rewritten at each of the round's steps, because a population's list is megabytes."""
        write_atomic(self._dir(rnd) / "online.json", json.dumps(online).encode(), durable=self.durable)

    def save_report(self, rnd: int, client: str, loss: float) -> None:
        """One report of the round, appended to its report log (what ``load`` adds to the state's
        ``reported``)."""
        line = json.dumps([client, loss]).encode() + b"\n"
        append_line(self._dir(rnd) / REPORTS, line, durable=self.durable)

    def _update_file(self, rnd: int, key: str) -> Path:
        if not _KEY.match(key):  # client ids are validated by the envelope; never let a name leave the dir
            raise ValueError(f"bad spool key {key!r}")
        return self.root / f"r{rnd:06d}" / f"update-{key}.msg"

    def save_update(self, rnd: int, key: str, body: bytes) -> None:
        path = self._update_file(rnd, key)
        self._dir(rnd)
        with self._free_lock:
            reuse = self._free.pop() if self._free else None
        write_atomic(path, body, durable=self.durable, reuse=reuse)

    def read_update(self, rnd: int, key: str) -> bytes | None:
        """The bytes spooled under ``key``, as they came; None when they are gone (or unreadable)."""
        try:
            return self._update_file(rnd, key).read_bytes()
        except OSError:
            return None

    def drop_update(self, rnd: int, key: str) -> None:
        """Forget a spooled update (one rejected when its turn came: a restart must not fold it)."""
        self._update_file(rnd, key).unlink(missing_ok=True)

    def load(self, rnd: int) -> tuple[dict[str, Any] | None, list[str]]:
        """The round's state (None if it has none) and the keys of its spooled updates, sorted (read each
        with ``read_update`` when it is needed)."""
        d = self.root / f"r{rnd:06d}"
        if not d.is_dir():
            return None, []
        state_file = d / "round.json"
        state = json.loads(state_file.read_text()) if state_file.is_file() else None
        if state is not None and "online" not in state:
            online_file = d / "online.json"
            state["online"] = json.loads(online_file.read_text()) if online_file.is_file() else []
        if state is not None and (d / REPORTS).is_file():
            state["reported"] = {**state.get("reported", {}), **_read_reports(d / REPORTS)}
        return state, sorted(p.stem.removeprefix("update-") for p in d.glob("update-*.msg"))

    def save_base(self, version: int, state: dict[str, Any]) -> None:
        """Async mode folds updates trained from any of the last max_staleness versions: keep those versions
        here so a restarted aggregator can replay the open round's spooled updates against their own base."""
        import io

        import torch

        buf = io.BytesIO()
        torch.save(state, buf)
        d = self.root / "bases"
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(d / f"v{version:06d}.pt", buf.getvalue(), durable=self.durable)

    def load_bases(self, oldest: int) -> dict[int, dict[str, Any]]:
        """The saved bases from version ``oldest`` on (older ones are deleted)."""
        import torch

        bases: dict[int, dict[str, Any]] = {}
        for path in sorted((self.root / "bases").glob("v*.pt")):
            version = int(path.stem[1:])
            if version < oldest:
                path.unlink(missing_ok=True)
            else:
                bases[version] = torch.load(path, weights_only=True)
        return bases

    def drop_bases_before(self, oldest: int) -> None:
        for path in (self.root / "bases").glob("v*.pt"):
            if int(path.stem[1:]) < oldest:
                path.unlink(missing_ok=True)

    def clear_upto(self, rnd: int) -> None:
        """Delete the spools of rounds up to ``rnd``, keeping their update files in FREE for the next
        updates to write over, as many as these rounds had (any more left there are deleted)."""
        free, kept = self.root / FREE, 0
        for d in _listed(self.root, "r*"):
            if d.is_dir() and d.name[1:].isdigit() and int(d.name[1:]) <= rnd:
                kept += sum(_moved(f, free) for f in _listed(d, "update-*.msg"))
                shutil.rmtree(d, ignore_errors=True)
        files = sorted(_listed(free, "*.msg"))
        with self._free_lock:
            self._free = files[:kept]
        for f in files[kept:]:
            f.unlink(missing_ok=True)

    def drop_free(self) -> None:
        """Delete the kept update files (the job is over: no update will write over them)."""
        with self._free_lock:
            self._free = []
        shutil.rmtree(self.root / FREE, ignore_errors=True)


def _listed(d: Path, pattern: str) -> list[Path]:
    """``d``'s entries matching ``pattern``; none when ``d`` is gone (another process cleared it)."""
    try:
        return list(d.glob(pattern))
    except OSError:
        return []


def _moved(f: Path, free: Path) -> int:
    """1 if ``f`` went into ``free`` (under a new name: keys repeat across rounds), else 0."""
    try:
        free.mkdir(exist_ok=True)
        os.replace(f, free / f"{uuid.uuid4().hex}.msg")
    except OSError:
        return 0
    return 1


def _read_reports(path: Path) -> dict[str, float]:
    """A report log's reports; a line cut short by a crash (its report was never acked) is skipped."""
    reports: dict[str, float] = {}
    for line in path.read_bytes().splitlines():
        try:
            client, loss = json.loads(line)
        except (ValueError, TypeError):  # cut short, or damaged on disk
            continue
        if isinstance(client, str) and isinstance(loss, (int, float)):
            reports[client] = float(loss)
    return reports
