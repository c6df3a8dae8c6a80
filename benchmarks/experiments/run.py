"""``fedmq experiment``: checks its arguments, runs an experiment's grid for each seed and writes its
results."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fedmq.benchmarks import results_file
from fedmq.benchmarks.experiments.grids import NAMES, grid, select, trace_file
from fedmq.benchmarks.experiments.nmt_domains import run_nmt_domains
from fedmq.benchmarks.experiments.nmt_grid import nmt_specs
from fedmq.benchmarks.experiments.results import (
    add_rounds_to_target,
    combine_seeds,
    results_markdown,
    table_row,
    write_results_file,
)
from fedmq.benchmarks.experiments.runner import Runner
from fedmq.benchmarks.experiments.spec import SCALES, ExperimentError
from fedmq.files import write_atomic
from fedmq.tasks.corpora import find
from fedmq.tasks.errors import TaskError


def check_args(name: str, scale: str, threads: int = 1, device: str = "cpu") -> None:
    """One clear error line for a bad experiment name, scale, thread count or device
    (before anything is written)."""
    from fedmq.tasks.training import resolve_device

    if name not in NAMES:
        raise ExperimentError(f"unknown experiment {name!r}; choose one of {', '.join(NAMES)}")
    if scale not in SCALES:
        raise ExperimentError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    if threads < 1:
        raise ExperimentError(f"threads must be at least 1, got {threads}")
    resolve_device(device)  # --device cuda without a GPU


def corpora_needed(name: str, scale: str, only: str | None = None) -> list[str]:
    """The corpora experiment ``name`` reads at ``scale`` (the runs ``only`` picks: ``select``): names in the
    data folder (fedmq.tasks.corpora)."""
    if name == "nmt-domains":
        return ["de-en"]
    return sorted({spec.labels["corpus"] for spec in select(grid(name, scale), only, None)})


def check_corpora(name: str, scale: str, only: str | None = None) -> None:
    """One error line naming the folder looked in when a corpus the experiment reads is not on this machine
    (before anything is written)."""
    for corpus in corpora_needed(name, scale, only):
        try:
            find(corpus)
        except TaskError as exc:
            raise ExperimentError(str(exc)) from None


def run_lm_experiment(
    name: str,
    scale: str,
    out: Path,
    simulation: Callable[..., Any],
    seed: int = 0,
    only: str | None = None,
    overrides: dict[str, Any] | None = None,
    device: str = "cpu",
    shared: Path | None = None,
    cohort: bool = False,
) -> dict[str, Any]:
    runner = Runner(out, simulation, device=device, shared=shared, cohort=cohort)
    specs = select(grid(name, scale), only, overrides)
    if name == "dropout":
        for spec in specs:
            if spec.availability == "trace":
                spec.availability = f"trace:{trace_file(out, spec.job['clients'], spec.job['rounds'])}"
    results = []
    for spec in specs:
        summary = runner.federate(spec, seed=seed)
        results.append(table_row(spec, summary, out / spec.name))
    info: dict[str, Any] = {}
    if name == "rounds-to-target":
        info["target"] = add_rounds_to_target(out, results, "fedavg-e1")
    return {"runs": results, **info}


def parse_seeds(text: str) -> list[int]:
    """``--seeds 0,1,2`` -> [0, 1, 2]; one clear error for anything else."""
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise ExperimentError(f"--seeds wants comma-separated whole numbers, got {text!r}") from None
    if len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise ExperimentError(f"--seeds wants distinct whole numbers >= 0, got {text!r}")
    return seeds


def _check_run(
    name: str,
    scale: str,
    seeds: list[int],
    threads: int,
    device: str,
    only: str | None,
    overrides: dict[str, Any] | None,
) -> None:
    """Every argument of ``run_experiment`` checked before anything is written."""
    check_args(name, scale, threads, device)
    if not seeds or len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise ExperimentError(f"seeds must be distinct whole numbers >= 0, got {seeds}")
    if name != "nmt-domains":
        select(grid(name, scale), only, overrides)
    elif (
        overrides
    ):  # --set would change the federations but not the local-only baselines they are read against
        raise ExperimentError("--set applies to the language-modelling experiments, not nmt-domains")
    elif only:
        select(nmt_specs(scale), only, None)
    check_corpora(name, scale, only)


def run_experiment(
    name: str,
    scale: str = "cpu",
    out: Path | str | None = None,
    seeds: Sequence[int] = (0,),
    threads: int = 1,
    *,
    simulation: Callable[..., Any],
    report: Callable[[list[Path], Path], Any] | None = None,
    only: str | None = None,
    overrides: dict[str, Any] | None = None,
    device: str = "cpu",
    cohort: bool = False,
) -> dict[str, Any]:
    """Run experiment ``name`` at ``scale`` for each seed; results under ``out/name``;
    returns the results dict.

    ``simulation`` runs a federation (:class:`Runner`); ``report`` (cli.report.run_report; None: none) draws
    each results folder's report from its run folders (module docstring).

    One seed writes its run folders to ``out/name/<run>``; several write ``out/name/seed-<s>/<run>`` and the
    results table gives mean ± sd over seeds, plus the paired orderings (``orderings``). Rerunning the same
    command skips finished runs and resumes unfinished ones (``Runner.federate``).
    ``only``: run a subset of the grid (several processes can share one grid this way); ``overrides`` (LM
    experiments only): with changed job settings, for the investigations in docs/results/ (e.g. more rounds);
    the results record them. ``cohort``: train each round's selected clients together (``Simulation.cohort``).
    """
    seeds = list(seeds)
    _check_run(name, scale, seeds, threads, device, only, overrides)
    exp_dir = Path(out or "runs/experiments") / name
    exp_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    started = time.time()
    folders = [exp_dir] if len(seeds) == 1 else [exp_dir / f"seed-{s}" for s in seeds]
    per_seed = []
    for seed, folder in zip(seeds, folders):
        folder.mkdir(parents=True, exist_ok=True)
        if name == "nmt-domains":
            per_seed.append(run_nmt_domains(scale, folder, simulation, seed, cache=exp_dir, only=only))
        else:
            per_seed.append(
                run_lm_experiment(
                    name,
                    scale,
                    folder,
                    simulation,
                    seed,
                    only,
                    overrides,
                    device,
                    shared=exp_dir.parent,
                    cohort=cohort,
                )
            )
    results = combine_seeds(name, seeds, per_seed)
    results.update(
        experiment=name,
        scale=scale,
        seeds=seeds,
        threads=threads,
        only=only,
        overrides=overrides or {},
        wall_s=round(time.time() - started, 1),
    )
    write_atomic(exp_dir / "results.json", json.dumps(results, indent=1, default=str))
    write_atomic(exp_dir / "results.md", results_markdown(name, scale, seeds, per_seed, results, overrides))
    command = results_file.command_line(name, scale, seeds, threads, only, overrides, device, cohort)
    write_results_file(exp_dir, name, scale, seeds, folders, per_seed, command, overrides)
    if report is not None:
        for folder, r in zip(folders, per_seed):
            report([folder / row["run"] for row in r["runs"]], folder / "report")
    return results
