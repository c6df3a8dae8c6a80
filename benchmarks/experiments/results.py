"""The results of an experiment: a run's row, mean ± sd and orderings over seeds, the markdown tables,
and the results file kept in git."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedmq.aggregator.records import RoundRecord
from fedmq.aggregator.runlog import read_rounds
from fedmq.benchmarks import results_file
from fedmq.benchmarks.experiments.spec import RunSpec
from fedmq.benchmarks.markdown import table as markdown_table

ROOT = Path(__file__).resolve().parents[2]


def table_row(spec: RunSpec, summary: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The row of ``spec``'s run in the experiment's table (results.json, results.md)."""
    rows = read_rounds(run_dir).records
    return {
        "run": spec.name,
        **spec.labels,
        "fraction": spec.job.get("fraction"),
        "test": summary.get("test"),
        "best_valid": summary.get("best_valid"),
        "best_round": summary.get("best_round"),
        "rounds_completed": summary.get("rounds_completed"),
        "rounds_skipped": summary.get("rounds_skipped"),
        "bytes_up": summary.get("bytes_up"),
        "bytes_down": summary.get("bytes_down"),
        "bytes_up_raw": sum(r.bytes_up_raw or 0 for r in rows),
        "bytes_down_raw": sum(r.bytes_down_raw or 0 for r in rows),
        "updates_received": sum(len(r.received) for r in rows),
        "valid_curve": [r.valid for r in rows],
        "max_jump": max_jump([r.valid for r in rows]),
        "wall_s": round(summary.get("run_wall_s", 0.0), 1),
    }


def max_jump(curve: list[float | None], after: int = 3) -> float | None:
    """Largest round-to-round rise of validation perplexity after round ``after`` (valid_r / valid_{r-1});
    a curve that trains keeps it at most 1.5. None with fewer rounds than that."""
    ratios = [b / a for a, b in zip(curve[after - 1 :], curve[after:]) if a and b]
    return max(ratios) if ratios else None


def rounds_to(rows: Sequence[RoundRecord], target: float) -> tuple[int | None, int | None]:
    """(first round whose validation perplexity <= target, cumulative bytes up+down until then) or
    (None, None)."""
    total = 0
    for r in rows:
        total += (r.bytes_up or 0) + (r.bytes_down or 0)
        if r.valid is not None and r.valid <= target:
            return r.round, total
    return None, None


def add_rounds_to_target(out: Path, results: list[dict[str, Any]], reference: str) -> float | None:
    """Target = the best validation perplexity the ``reference`` run reached; fills rounds/bytes to reach it.

    (The best, not the last: at small scales the validation curve is far from monotone, and the last value
    is often reached by every run in round 1.)"""
    ref = next((r for r in results if r["run"] == reference), None)
    curve = [v for v in (ref or {}).get("valid_curve", []) if v is not None]
    if not curve:
        return None
    target = min(curve)
    for r in results:
        r["target"] = target
        r["rounds_to_target"], r["bytes_to_target"] = rounds_to(read_rounds(out / r["run"]).records, target)
    return target


def fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.2f}" if abs(value) >= 10 or value == 0 else f"{value:.4g}"
    if isinstance(value, list):
        return " ".join(fmt(v) if v is not None else "·" for v in value)
    return str(value)


def markdown(results: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    columns = columns or [k for k in results[0] if k != "valid_curve"] if results else []
    return markdown_table(columns, [[fmt(r.get(c)) for c in columns] for r in results])


def domain_markdown(table: dict[str, dict[str, float]], domains: list[str], digits: int = 2) -> str:
    """A model x domain table (BLEU, or cross-entropy with ``digits`` 3) with each model's mean over
    domains."""
    rows = []
    for name, scores in table.items():
        vals = [scores[d] for d in domains]
        rows.append([name, *(f"{v:.{digits}f}" for v in (*vals, sum(vals) / len(vals)))])
    return markdown_table(["model", *domains, "mean"], rows)


COLUMNS = {
    "table2": ["run", "corpus", "strategy", "C", "test", "best_valid", "best_round", "bytes_up", "wall_s"],
    "sweep": ["run", "lr", "momentum", "best_valid", "best_round", "max_jump", "valid_curve", "wall_s"],
    "fraction": ["run", "strategy", "C", "test", "best_valid", "best_round", "bytes_up", "wall_s"],
    "rounds-to-target": [
        "run",
        "strategy",
        "E",
        "encoding",
        "test",
        "target",
        "rounds_to_target",
        "bytes_to_target",
        "bytes_up",
        "bytes_up_raw",
        "wall_s",
    ],
    "topk": ["run", "beta", "test", "best_valid", "updates_received", "bytes_up", "wall_s"],
    "randomization": ["run", "strategy", "noise", "test", "best_valid", "best_round", "wall_s"],
    "scale": ["run", "model", "tied", "test", "best_valid", "best_round", "wall_s"],
    "dropout": [
        "run",
        "availability",
        "faults",
        "test",
        "best_valid",
        "rounds_completed",
        "rounds_skipped",
        "updates_received",
        "wall_s",
    ],
    "nmt-domains": [
        "run",
        "strategy",
        "pull",
        "directions",
        "test",
        "bleu_mean_domains",
        "ce_mean_domains",
        "best_round",
        "ce_pick_round",
        "bleu_ce_pick",
        "ce_ce_pick",
        "bytes_up_per_round",
        "bytes_up",
        "bytes_up_raw",
        "bytes_down_raw",
        "wall_s",
    ],
}


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    m = math.fsum(values) / len(values)
    sd = math.sqrt(math.fsum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return m, sd


def across_seeds(per_seed: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per run of the grid: its labels, and test / best-validation perplexity as mean ± sd over
    seeds."""
    rows = []
    for first in per_seed[0]:
        same = [r for runs in per_seed for r in runs if r["run"] == first["run"]]
        row = {k: v for k, v in first.items() if k not in (*_PER_RUN, *_EACH_SEED)}
        for metric in _MEAN_SD:
            if not any(metric in r for r in same):
                continue
            vals = [r[metric] for r in same if r.get(metric) is not None and math.isfinite(r[metric])]
            row[metric], row[f"{metric}_sd"] = mean_sd(vals) if vals else (None, None)
        for count in _MEAN_COUNTS:
            vals = [r[count] for r in same if r.get(count) is not None]
            row[count] = round(mean_sd(vals)[0]) if vals else None
        for (
            each
        ) in _EACH_SEED:  # values that differ by seed and do not average (a round; None: never reached)
            if any(each in r for r in same):
                row[each] = " / ".join(fmt(r.get(each)) for r in same)
        jumps = [r["max_jump"] for r in same if r.get("max_jump") is not None]
        row["max_jump"] = max(jumps) if jumps else None
        row["seeds"] = len(same)
        row["wall_s"] = round(math.fsum(r.get("wall_s") or 0.0 for r in same), 1)
        rows.append(row)
    return rows


_PER_RUN = (
    "test",
    "best_valid",
    "bleu_mean_domains",
    "ce_mean_domains",
    "bleu_ce_pick",
    "ce_ce_pick",
    "best_round",
    "valid_curve",
    "max_jump",
    "wall_s",
    "bytes_up",
    "bytes_down",
    "bytes_up_raw",
    "bytes_down_raw",
    "bytes_up_per_round",
    "updates_received",
    "rounds_completed",
    "rounds_skipped",
)
# in a several-seed row: _MEAN_SD as mean and sd over seeds, counts as their mean,
# _EACH_SEED listed seed by seed ("3 / 5 / —")
_MEAN_SD = ("test", "best_valid", "bleu_mean_domains", "ce_mean_domains", "bleu_ce_pick", "ce_ce_pick")
_MEAN_COUNTS = (
    "bytes_up",
    "bytes_down",
    "bytes_up_raw",
    "bytes_down_raw",
    "updates_received",
    "rounds_completed",
    "rounds_skipped",
    "bytes_up_per_round",
)
_EACH_SEED = ("best_round", "ce_pick_round", "target", "rounds_to_target", "bytes_to_target")


def orderings(
    per_seed: list[list[dict[str, Any]]],
    metric: str = "test",
    higher_is_better: bool = False,
    digits: int = 2,
) -> list[str]:
    """Pairwise comparisons of ``metric`` (test perplexity; nmt-domains: the per-domain mean BLEU, higher
    better) between the runs that share a corpus and client fraction C (every pair of a C = 0.5 grid such as
    randomization's: strategy against strategy, noise against noise; every pair of nmt-domains' grid, all at
    C = 1), paired by seed (a seed fixes the initial model, the client sampling and local batch order; the LM
    tasks' IID shards are seed 0's in every seed): "A < B in k/n seeds, difference mean ± sd" (A is the better
    one: ">" when higher is better). An ordering is called resolved when it holds in every seed and the mean
    difference exceeds its sd."""
    lines = []
    runs = per_seed[0]
    sign = (
        -1.0 if higher_is_better else 1.0
    )  # diffs are "how much worse the second is", so > 0 favours the first
    for i, a in enumerate(runs):
        for b in runs[i + 1 :]:
            if a.get("fraction") is None or (a.get("corpus"), a["fraction"]) != (
                b.get("corpus"),
                b.get("fraction"),
            ):
                continue
            diffs = []
            for seed_runs in per_seed:
                ta = next((r.get(metric) for r in seed_runs if r["run"] == a["run"]), None)
                tb = next((r.get(metric) for r in seed_runs if r["run"] == b["run"]), None)
                if ta is not None and tb is not None:
                    diffs.append(sign * (tb - ta))
            if not diffs:
                continue
            better, worse = a["run"], b["run"]
            if math.fsum(diffs) < 0:  # b is the better one: state it first
                better, worse, diffs = worse, better, [-d for d in diffs]
            wins = sum(1 for d in diffs if d > 0)
            m, sd = mean_sd(diffs)
            resolved = wins == len(diffs) and len(diffs) > 1 and m > sd
            verdict = " (resolved)" if resolved else " (not resolved)"
            lines.append(
                f"{better} {'>' if higher_is_better else '<'} {worse} in {wins}/{len(diffs)} seeds, "
                f"difference {m:.{digits}f} ± {sd:.{digits}f}{verdict}"
            )
    return lines


def write_results_file(
    exp_dir: Path,
    name: str,
    scale: str,
    seeds: list[int],
    folders: list[Path],
    per_seed: list[dict[str, Any]],
    command: str,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write ``exp_dir/NAME.SCALE.json``, the results file kept in git (benchmarks/results_file.py): each
    run's final numbers by seed, ``command`` (the one that reruns them: results_file.command_line) and the
    commit. Its path."""
    rows = [
        results_file.run_row(row, folder / row["run"], seed)
        for seed, folder, seed_results in zip(seeds, folders, per_seed)
        for row in seed_results["runs"]
    ]
    first = per_seed[0]
    models = pretrain = None
    if "bleu_by_domain" in first:  # nmt-domains: the pre-trained engine and the clients alone
        models = results_file.nmt_models(first["bleu_by_domain"], first.get("ce_by_domain") or {})
        pretrain = {**first.get("pretrain", {}), "wall_s": first.get("pretrain_s")}
    commit, dirty = results_file.git_commit(ROOT)
    path = exp_dir / results_file.file_name(name, scale)
    doc = results_file.document(name, scale, rows, command, overrides, commit, dirty, models, pretrain)
    results_file.write(path, doc)
    return path


def seed_columns(columns: list[str]) -> list[str]:
    """The columns of a several-seed table: per-seed-only ones dropped, an sd beside each averaged metric."""
    out = []
    for c in columns:
        if c in _MEAN_SD:
            out += [c, f"{c}_sd"]
        elif c not in _PER_RUN or c in ("max_jump", "wall_s", *_MEAN_COUNTS, *_EACH_SEED):
            out.append(c)
    return out + ["seeds"]


def combine_seeds(name: str, seeds: list[int], per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """An experiment's results: one seed's as they are; several seeds' as one row per run (``across_seeds``),
    the paired orderings (``orderings``) and each seed's results."""
    if len(seeds) == 1:
        return per_seed[0]
    return {
        "runs": across_seeds([r["runs"] for r in per_seed]),
        "orderings": (
            orderings([r["runs"] for r in per_seed])
            if name != "nmt-domains"
            else orderings([r["runs"] for r in per_seed], "bleu_mean_domains", higher_is_better=True)
        ),
        **(
            {
                "orderings_ce": orderings([r["runs"] for r in per_seed], "ce_mean_domains", digits=3),
                "orderings_ce_pick": orderings([r["runs"] for r in per_seed], "ce_ce_pick", digits=3),
            }
            if name == "nmt-domains"
            else {}
        ),
        "per_seed": {str(s): r for s, r in zip(seeds, per_seed)},
    }


def results_markdown(
    name: str,
    scale: str,
    seeds: list[int],
    per_seed: list[dict[str, Any]],
    results: dict[str, Any],
    overrides: dict[str, Any] | None,
) -> str:
    """results.md: the experiment's table, its orderings over seeds and, for nmt-domains, each seed's
    per-domain BLEU and cross-entropy."""
    changed = f", overrides {overrides}" if overrides else ""
    columns = COLUMNS[name] if len(seeds) == 1 else seed_columns(COLUMNS[name])
    seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))}, mean ± sd"
    text = [
        f"# {name} ({scale} scale{changed}, {seed_text}, wall {results['wall_s']} s)",
        "",
        markdown(results["runs"], columns),
    ]
    if results.get("orderings"):
        what = "test perplexity" if name != "nmt-domains" else "the per-domain mean BLEU"
        text += ["", f"Orderings of {what} (paired by seed):", ""] + [f"- {o}" for o in results["orderings"]]
    for key, heading in (
        ("orderings_ce", "Orderings of the per-domain mean cross-entropy, nats a token, lower is better"),
        ("orderings_ce_pick", "The same, each server read at its round of lowest validation cross-entropy"),
    ):
        if results.get(key):
            paired = "(paired by seed)" if key == "orderings_ce" else "(ce_pick_round)"
            text += ["", f"{heading} {paired}:", ""] + [f"- {o}" for o in results[key]]
    for seed, r in zip(seeds, per_seed):
        if "bleu_by_domain" in r:
            text += [
                "",
                f"BLEU on each domain's test pairs (seed {seed}):",
                "",
                domain_markdown(r["bleu_by_domain"], r["domains"]),
            ]
        if r.get("ce_by_domain"):
            text += [
                "",
                "Cross-entropy (nats a reference token, teacher forcing) on each domain's test pairs "
                f"(seed {seed}):",
                "",
                domain_markdown(r["ce_by_domain"], r["domains"], digits=3),
            ]
    return "\n".join(text) + "\n"
