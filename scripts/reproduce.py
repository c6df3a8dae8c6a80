"""Reproduce the seed papers' experiments: ``python scripts/reproduce.py NAME|all [--scale S]``.

Same as ``fedmq experiment NAME``; ``all`` runs every experiment one after the other, ``--only``/``--set`` run
a subset with changed settings (see docs/results/method.md). A script above both cli and benchmarks: it hands
the CLI's Simulation and report to benchmarks.experiments, which cannot import cli (its docstring says why).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedmq.benchmarks.experiments import (
    NAMES,
    SCALES,
    ExperimentError,
    check_args,
    parse_seeds,
    run_experiment,
)  # noqa: E402
from fedmq.cli.report import run_report  # noqa: E402
from fedmq.errors import FedmqError  # noqa: E402
from fedmq.simulation import Simulation  # noqa: E402


def parse_overrides(items: list[str]) -> dict[str, object]:
    """``KEY=VALUE`` pairs; VALUE as JSON when it parses (numbers, true/false), else as text."""
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ExperimentError(f"--set wants KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("name", help=f"{' | '.join(NAMES)} | all")
    parser.add_argument("--scale", default="cpu", choices=SCALES)
    parser.add_argument("--out", type=Path, default=Path("runs/experiments"))
    parser.add_argument(
        "--seeds", default="0", help="comma-separated seeds; several: mean ± sd (rerun to resume)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="local training: cpu | cuda | auto (LM experiments)")
    parser.add_argument(
        "--cohort",
        action="store_true",
        help="train each round's selected clients together, one batched model (for a GPU)",
    )
    parser.add_argument(
        "--only",
        help="run only these runs of the grid (comma-separated: a run's whole name, or text its name "
        "contains)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a job setting of every run, e.g. --set rounds=15 --set max_steps=10",
    )
    args = parser.parse_args(argv)
    names = list(NAMES) if args.name == "all" else [args.name]
    try:
        overrides = parse_overrides(args.set)
        seeds = parse_seeds(args.seeds)
        for name in names:
            check_args(name, args.scale, args.threads, args.device)
        for name in names:
            results = run_experiment(
                name,
                args.scale,
                args.out,
                seeds,
                args.threads,
                simulation=Simulation,
                report=run_report,
                only=args.only,
                overrides=overrides,
                device=args.device,
                cohort=args.cohort,
            )
            sys.stdout.write((args.out / name / "results.md").read_text() + f"\n({results['wall_s']} s)\n\n")
    except FedmqError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(
            "interrupted: each finished round is checkpointed; rerun the same command to resume\n"
        )
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
