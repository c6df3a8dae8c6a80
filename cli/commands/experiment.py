"""`fedmq experiment`: a seed paper's experiment, reproduced."""

from __future__ import annotations

from pathlib import Path

import typer

from fedmq.cli import options
from fedmq.cli.process import reproducible_blas, setup_logs


def experiment(
    name: str = typer.Argument(
        ...,
        help="table2, sweep, fraction, rounds-to-target, topk, randomization, scale, dropout or nmt-domains",
    ),
    scale: str = typer.Option(
        "cpu", help="smoke (CI, seconds) | cpu (minutes a run on a CPU) | paper (the papers' settings, GPU)"
    ),
    out: Path = typer.Option(
        Path("runs/experiments"), help="results go to OUT/NAME (run folders, results.md, report/)"
    ),
    seeds: str = typer.Option(
        "0", help="seeds for sampling, shards and init, e.g. 0,1,2 (several: mean ± sd)"
    ),
    threads: int = typer.Option(1, help="torch intra-op threads"),
    device: str = typer.Option("cpu", help="local training of the LM experiments: cpu | cuda | auto"),
    cohort: bool = typer.Option(False, "--cohort", help="train each round's selected clients together (GPU)"),
    log_level: str = options.LOG_LEVEL,
) -> None:
    """Reproduce a seed paper's experiment (docs/results/).

    Example: fedmq experiment table2 --scale cpu --seeds 0,1,2   (rerun the same command to resume)
    """
    from fedmq.benchmarks import experiments
    from fedmq.cli.report import run_report
    from fedmq.simulation import Simulation

    experiments.check_args(name, scale, threads, device)
    seed_list = experiments.parse_seeds(seeds)
    experiments.check_corpora(name, scale)  # a missing corpus is one line, and nothing is written
    setup_logs(log_level, "json", out / name / "experiment.jsonl")
    reproducible_blas()
    experiments.run_experiment(
        name,
        scale,
        out,
        seed_list,
        threads,
        simulation=Simulation,
        report=run_report,
        device=device,
        cohort=cohort,
    )
    typer.echo((out / name / "results.md").read_text())
