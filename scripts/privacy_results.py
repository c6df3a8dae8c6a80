"""Collect the privacy page's run folders into its results file
(benchmarks/results/commands/privacy.k10000.json: made by command lines, not by an experiment grid).

.venv/bin/python scripts/privacy_results.py OUT NAME=RUN_DIR [NAME=RUN_DIR ...] [--label NAME:KEY=VALUE ...]
    [--add]

Each row is benchmarks/results_file.run_row's (test, best validation, the validation curve, bytes, wall
times) plus what a DP comparison needs: the run's privacy settings (``dp``, ``target_epsilon``, ``delta``,
``clip_norm``, ``noise_multiplier``: z as the run derived it), ``epsilon_curve`` (ε after each round, null
without DP), ``time_curve`` (seconds from the start of round 1 to each round's close, for time to a
target) and ``received_curve`` (the updates folded each round). ``--label`` adds a table label to one row
(e.g. ``sync-s0:availability=bernoulli:0.5``). ``--add`` keeps OUT's rows for the names not given (a new
seed added to the page without its earlier run folders); without it OUT holds exactly the runs given.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedmq.aggregator.runlog import read_rounds, read_summary  # noqa: E402
from fedmq.benchmarks import results_file  # noqa: E402

COMMAND = "the command lines of docs/results/privacy.md"


def privacy_row(name: str, run_dir: Path, labels: dict[str, str]) -> dict[str, Any]:
    """One run's row (module docstring)."""
    config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    summary = read_summary(run_dir) or {}
    plan = summary.get("dp") if isinstance(summary.get("dp"), dict) else {}
    table = {
        "run": name,
        "corpus": "wikitext-2",
        "strategy": config["strategy"],
        "fraction": config["fraction"],
        "clients": config["clients"],
        "dp": config["dp"],
        "target_epsilon": config["target_epsilon"],
        **labels,
    }
    row = results_file.run_row(table, run_dir, config["seed"])
    row.update(
        (k, summary.get(k))
        for k in ("test", "best_valid", "best_round", "rounds_completed", "rounds_skipped", "wall_s")
    )
    records = read_rounds(run_dir).records
    if config["dp"] != "none":
        row["delta"] = records[-1].delta if records else None
        row["epsilon"] = summary.get("epsilon")
        row["clip_norm"] = plan.get("clip_norm", config["clip_norm"])
        row["noise_multiplier"] = plan.get("noise_multiplier")
        row["epsilon_curve"] = [results_file.sig(r.epsilon) for r in records]
    row["received_curve"] = [len(r.received) for r in records]
    if records and records[0].time is not None and records[0].wall_s is not None:
        start = records[0].time - records[0].wall_s
        row["time_curve"] = [round(r.time - start, 1) if r.time is not None else None for r in records]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", nargs="+", help="NAME=RUN_DIR")
    parser.add_argument("--label", action="append", default=[], help="NAME:KEY=VALUE")
    parser.add_argument("--add", action="store_true", help="keep OUT's rows for the names not given")
    args = parser.parse_args(argv)
    labels: dict[str, dict[str, str]] = {}
    for item in args.label:
        name, _, pair = item.partition(":")
        key, _, value = pair.partition("=")
        labels.setdefault(name, {})[key] = value
    rows = []
    for item in args.runs:
        name, _, folder = item.partition("=")
        rows.append(privacy_row(name, Path(folder), labels.get(name, {})))
    if args.add and args.out.exists():
        given = {row["run"] for row in rows}
        kept = json.loads(args.out.read_text(encoding="utf-8"))["runs"]
        rows = [row for row in kept if row["run"] not in given] + rows
    commit, dirty = results_file.git_commit(ROOT)
    results_file.write(
        args.out, results_file.document("privacy", "k10000", rows, COMMAND, commit=commit, dirty=dirty)
    )
    print(f"wrote {args.out} ({len(rows)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
