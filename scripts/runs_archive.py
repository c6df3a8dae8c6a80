"""Keep the finished runs of an experiment folder across sessions (runs/ is not tracked and a new checkout starts
without it): ``save`` copies each finished run's small files (the experiment's spec.json and the run log's config,
metrics and summary: aggregator.runlog.RECORD_FILES) into a tracked folder; ``restore`` copies them back, so rerunning the experiment's command keeps those runs
(benchmarks/experiments.py: a run whose spec.json says done is not run again) and runs only the rest.

    python scripts/runs_archive.py save runs/exp14 benchmarks/records/exp14
    python scripts/runs_archive.py restore benchmarks/records/exp14 runs/exp14
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedmq.aggregator import runlog  # noqa: E402

FILES = ("spec.json", *runlog.RECORD_FILES)


def finished(run: Path) -> bool:
    try:
        return bool(json.loads((run / "spec.json").read_text()).get("done")) and runlog.finished(run)
    except (OSError, ValueError):
        return False


def copy_runs(src: Path, dst: Path) -> int:
    """Copy FILES of every finished run under ``src`` to the same relative place under ``dst``; the count."""
    count = 0
    for spec in sorted(src.rglob("spec.json")):
        run = spec.parent
        if not finished(run):
            continue
        target = dst / run.relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            if (run / name).is_file():
                shutil.copy2(run / name, target / name)
        count += 1
    return count


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("save", "restore"):
        print("usage: runs_archive.py save|restore SRC DST", file=sys.stderr)
        return 2
    src, dst = Path(argv[1]), Path(argv[2])
    if not src.is_dir():
        print(f"error: {src} is not a folder", file=sys.stderr)
        return 2
    print(f"{argv[0]}d {copy_runs(src, dst)} finished runs from {src} to {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
