"""The nmt-domains experiment (Passban et al.): pre-training, each client alone, then the federations,
and the per-domain scores of each server."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

from fedmq.aggregator.checkpoint import read_checkpoint
from fedmq.aggregator.runlog import read_rounds, write_summary
from fedmq.benchmarks.experiments.grids import select
from fedmq.benchmarks.experiments.nmt_grid import NMT_SETTINGS, nmt_options, nmt_specs, nmt_train
from fedmq.benchmarks.experiments.results import table_row
from fedmq.benchmarks.experiments.runner import Runner
from fedmq.benchmarks.experiments.spec import ExperimentError
from fedmq.files import write_atomic
from fedmq.tasks.base import TrainConfig, load_state, model_state
from fedmq.tasks.nmt_domains import WarmStartTask, domain_bleu, domain_ce, pretrain_pairs

log = structlog.get_logger(__name__)


def _server_domain_scores(
    task: Any, run_dir: Path, summary: dict[str, Any], seed: int, n: int
) -> tuple[dict[str, float], dict[str, float] | None]:
    """Per-domain test BLEU and cross-entropy of a run's best global model, kept in its summary.json
    (``test_bleu_by_domain``, ``test_ce_by_domain``) so that a run folder kept without its weights (no
    best.pt) keeps its row; a finished run with no BLEU and no best.pt is refused
    rather than scored on another model. Cross-entropy is None for a restored run from before it was
    measured."""
    bleu, ce = summary.get("test_bleu_by_domain"), summary.get("test_ce_by_domain")
    if isinstance(bleu, dict) and isinstance(ce, dict):
        return bleu, ce
    best = run_dir / "best.pt"
    if not best.is_file():
        if isinstance(bleu, dict):
            return bleu, None
        raise ExperimentError(
            f"run {run_dir.name} has no best.pt and no per-domain BLEU in its summary.json "
            f"(restored from an older archive?): delete {run_dir} to run it again"
        )
    server = task.build_model(seed)
    load_state(server, torch.load(best, weights_only=True))
    if not isinstance(bleu, dict):
        summary["test_bleu_by_domain"] = bleu = domain_bleu(task, server, "test", n)
    summary["test_ce_by_domain"] = ce = domain_ce(task, server, "test", n)
    write_summary(run_dir, summary)
    return bleu, ce


def _ce_pick(task: Any, run_dir: Path, summary: dict[str, Any], seed: int, n: int) -> dict[str, Any] | None:
    """The server read at the round whose global model has the lowest validation cross-entropy (the mean over
    domains of each domain's, on all its validation pairs) rather than the engine's pick by BLEU on a few
    validation pairs: that round, every round's validation cross-entropy, and the chosen model's per-domain
    test BLEU and cross-entropy. Kept in summary.json (``ce_pick``); None for a run without every round's
    checkpoint (one from before they were kept, or restored from its small files)."""
    if isinstance(summary.get("ce_pick"), dict):
        return summary["ce_pick"]
    states = {}
    for path in sorted((run_dir / "checkpoints").glob("ckpt-*.fmq")):
        ckpt = read_checkpoint(path)
        states[ckpt.model_version] = ckpt.global_state  # a skipped round's checkpoint repeats its version
    if sorted(states) != list(range(1, summary.get("rounds_completed", 0) + 1)):
        return None
    server = task.build_model(seed)
    valid = {}
    for version, state in states.items():
        load_state(server, state)
        ce = domain_ce(task, server, "valid")
        valid[version] = sum(ce.values()) / len(ce)
    best = min(valid, key=valid.get)
    if best == summary.get("best_round"):  # the engine's pick: scored already
        bleu, ce = summary["test_bleu_by_domain"], summary["test_ce_by_domain"]
    else:
        load_state(server, states[best])
        bleu, ce = domain_bleu(task, server, "test", n), domain_ce(task, server, "test", n)
    summary["ce_pick"] = pick = {
        "round": best,
        "valid_ce_by_round": {str(k): v for k, v in valid.items()},
        "test_bleu_by_domain": bleu,
        "test_ce_by_domain": ce,
    }
    write_summary(run_dir, summary)
    return pick


_PRE_SEED = 0  # phases 1-2 do not depend on the run's seed: one engine for every seed, as in the paper


def _cache_key(options: dict[str, Any], settings: dict[str, Any]) -> str:
    """What a cached phase depends on: the task's options
    (not the run's seed or the cache folder) and ``settings``."""
    shared = {
        k: v for k, v in options.items() if k not in ("seed", "cache_dir")
    }  # the vocabulary does not vary
    return json.dumps({**shared, **settings, "seed": _PRE_SEED}, sort_keys=True)


def _pretrained_engine(
    task: Any, s: dict[str, Any], options: dict[str, Any], cache: Path
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any], float, dict[str, Any]]:
    """Phase 1: pre-train on the news/WMT data (not only the news client's shard; evaluated sentences
    excluded). Cached in ``cache`` (pretrained.pt + pretrain.json) keyed by the task and the pre-training
    settings alone, so that changing how the clients train does not pre-train again. Returns the state, its
    BLEU and cross-entropy rows, the seconds it took and its summary."""
    key = _cache_key(
        options, {k: v for k, v in s.items() if k.startswith("pretrain_") or k in ("task", "per_domain_test")}
    )
    cache_pt, cache_json = cache / "pretrained.pt", cache / "pretrain.json"
    cached = json.loads(cache_json.read_text()) if cache_json.is_file() and cache_pt.is_file() else {}
    if cached.get("key") == key:
        return (
            torch.load(cache_pt, weights_only=True),
            cached["table"],
            cached["ce"],
            cached["pretrain_s"],
            cached.get("pretrain", {}),
        )
    started = time.time()
    data = task.encode_pairs(pretrain_pairs(task, s["pretrain_domains"], s["pretrain_max_lines"]))
    model = task.build_model(_PRE_SEED)
    every = max(1, s["pretrain_steps"] // 20)

    def progress(step: int, total: int) -> None:
        if step % every == 0:
            log.info("pre-training", step=step, of=total, seconds=round(time.time() - started, 1))

    cfg = TrainConfig(
        batch_size=s["pretrain_batch"],
        lr=s["pretrain_lr"],
        optimizer="adam",
        clip=1.0,
        max_steps=s["pretrain_steps"],
        warmup_steps=s["pretrain_warmup"],
        linear_decay=True,
        adam_betas=(0.9, 0.98),
        seed=_PRE_SEED,
    )
    result = task.pretrain(model, data, cfg, progress)
    pretrained = {k: v.detach().clone() for k, v in model_state(model).items()}
    pretrain_s = time.time() - started
    info = {
        "pairs": len(data),
        "tokens": result.tokens,
        "loss": round(result.loss, 4),
        "train_s": round(result.seconds, 1),
    }
    log.info("pre-training done", **info)
    label = f"pre-trained ({'+'.join(s['pretrain_domains'])})"
    table = {label: domain_bleu(task, model, "test", s["per_domain_test"])}
    ce = {label: domain_ce(task, model, "test", s["per_domain_test"])}
    torch.save(pretrained, cache_pt)
    write_atomic(
        cache_json,
        json.dumps({"key": key, "table": table, "ce": ce, "pretrain_s": pretrain_s, "pretrain": info}),
    )
    return pretrained, table, ce, pretrain_s, info


def _local_only(
    task: Any, s: dict[str, Any], pretrained: dict[str, torch.Tensor], options: dict[str, Any], cache: Path
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Phase 2: each client alone -- the pre-trained engine fine-tuned on its own domain for as many epochs
    (or steps) as a federation gives it. Its BLEU and cross-entropy rows are cached in
    ``cache``/local-only.json, keyed by the pre-training and the clients' settings."""
    key = _cache_key(options, {k: v for k, v in s.items() if k != "fractions"})
    path = cache / "local-only.json"
    cached = json.loads(path.read_text()) if path.is_file() else {}
    if cached.get("key") == key:
        return cached["table"], cached["ce"]
    local_steps = s["rounds"] * (s["max_steps"] or 0)
    table, ce = {}, {}
    for i, client in enumerate(task.shard_names):
        m = task.build_model(_PRE_SEED)
        load_state(m, pretrained)
        task.train(
            m,
            i,
            TrainConfig(
                epochs=s["rounds"] if not local_steps else 100,
                max_steps=local_steps,
                seed=_PRE_SEED,
                **nmt_train(s),
            ),
        )
        table[f"client {client} (local only)"] = domain_bleu(task, m, "test", s["per_domain_test"])
        ce[f"client {client} (local only)"] = domain_ce(task, m, "test", s["per_domain_test"])
    write_atomic(path, json.dumps({"key": key, "table": table, "ce": ce}))
    return table, ce


def run_nmt_domains(
    scale: str,
    out: Path,
    simulation: Callable[..., Any],
    seed: int = 0,
    cache: Path | None = None,
    only: str | None = None,
) -> dict[str, Any]:
    """Passban et al.: pre-train on news, one client per domain, FedAvg; then DP_l / DP_g / random pulling.

    Phases 1-2 (pre-training, each client alone) do not depend on ``seed``: as in the paper, every federation
    starts from one pre-trained engine ("we initialize all the clients with WMT parameters"), so the seeds
    vary the federations (batch order, pull-random's draws), and the pre-trained model is built once (seed 0)
    and cached in ``cache`` (default ``out``) for every seed."""
    s = NMT_SETTINGS[scale]
    runner = Runner(out, simulation)
    cache = cache or out
    options = nmt_options(scale, seed, cache)
    task = runner.task("nmt", options)
    names = list(task.shard_names)
    n = s["per_domain_test"]
    pretrained, table, ce, pretrain_s, pretrain_info = _pretrained_engine(task, s, options, cache)
    local_bleu, local_ce = _local_only(task, s, pretrained, options, cache)
    table, ce = {**table, **local_bleu}, {**ce, **local_ce}
    warm = WarmStartTask(task, pretrained)
    # 3. FedAvg from the pre-trained model; then the dynamic-pulling variants
    specs = nmt_specs(scale, options)
    results = []
    for spec in select(specs, only, None):
        summary = runner.federate(spec, task=warm, seed=seed)
        row = table_row(spec, summary, out / spec.name)
        per_domain, per_domain_ce = _server_domain_scores(task, out / spec.name, summary, seed, n)
        table[f"server {spec.name}"] = per_domain
        row["bleu_mean_domains"] = sum(per_domain.values()) / len(per_domain)
        if per_domain_ce is not None:
            ce[f"server {spec.name}"] = per_domain_ce
            row["ce_mean_domains"] = sum(per_domain_ce.values()) / len(per_domain_ce)
        pick = _ce_pick(task, out / spec.name, summary, seed, n) if per_domain_ce is not None else None
        if pick is not None:
            table[f"server {spec.name}, CE pick"] = pick["test_bleu_by_domain"]
            ce[f"server {spec.name}, CE pick"] = pick["test_ce_by_domain"]
            row["ce_pick_round"] = pick["round"]
            row["bleu_ce_pick"] = sum(pick["test_bleu_by_domain"].values()) / len(pick["test_bleu_by_domain"])
            row["ce_ce_pick"] = sum(pick["test_ce_by_domain"].values()) / len(pick["test_ce_by_domain"])
        rounds = len(read_rounds(out / spec.name).records)
        row["bytes_up_per_round"] = row["bytes_up"] / max(rounds, 1)
        results.append(row)
    return {
        "runs": results,
        "bleu_by_domain": table,
        "ce_by_domain": ce,
        "domains": names,
        "pretrain_s": round(pretrain_s, 1),
        "pretrain_steps": s["pretrain_steps"],
        "pretrain": pretrain_info,
        "settings": {k: v for k, v in s.items() if k != "fractions"} | {"fractions": list(s["fractions"])},
    }
