"""scripts/runs_archive.py keeps finished experiment runs across sessions, and only finished ones."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("runs_archive", ROOT / "scripts" / "runs_archive.py")
runs_archive = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runs_archive)


def _run(folder: Path, done: bool) -> None:
    folder.mkdir(parents=True)
    (folder / "spec.json").write_text(json.dumps({"key": "k", "done": done}))
    (folder / "summary.json").write_text(json.dumps({"test": 1.0}))
    (folder / "metrics.jsonl").write_text('{"round": 1}\n')
    (folder / "best.pt").write_bytes(b"big")


def test_save_then_restore_keeps_finished_runs_only(tmp_path: Path) -> None:
    runs, kept, back = tmp_path / "runs", tmp_path / "kept", tmp_path / "back"
    _run(runs / "seed-0" / "a", done=True)
    _run(runs / "seed-0" / "b", done=False)
    assert runs_archive.main(["save", str(runs), str(kept)]) == 0
    assert sorted(p.name for p in (kept / "seed-0" / "a").iterdir()) == [
        "metrics.jsonl",
        "spec.json",
        "summary.json",
    ]
    assert not (kept / "seed-0" / "b").exists()
    assert runs_archive.main(["restore", str(kept), str(back)]) == 0
    assert json.loads((back / "seed-0" / "a" / "spec.json").read_text())["done"] is True
    assert runs_archive.main(["save", str(tmp_path / "missing"), str(kept)]) == 2
