"""The nmt-domains grid (data): the translation task, pre-training and client settings at each scale, and
the federations of the experiment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedmq.benchmarks.experiments.spec import DEADLINES, SCHEDULE, RunSpec, corpus_folder

# ----------------------------------------------------------------------------------------------- NMT
# task: TranslationTask options. pretrain_*: phase 1, Adam on the pairs of ``pretrain_domains`` (the first
# ``pretrain_max_lines`` of each, 0 = all; minus every pair whose source is in a valid/test split; pairs
# longer than max_len subwords skipped) for ``pretrain_steps`` steps of ``pretrain_batch`` pairs, lr warm-up
# over ``pretrain_warmup`` steps to ``pretrain_lr`` then linear decay to 0. lr: the clients' Adam lr (local
# only and federated); rounds x max_steps local steps of batch_size pairs; per_domain_test: BLEU on the first
# N test pairs of each domain.
# Passban et al.'s five clients are WMT, OpenSubtitles, TED, PHP and Ubuntu; the corpora here have one
# software domain (GNOME/KDE/PHP/Ubuntu strings, not split by source), so the fifth client is another small
# technical domain, EMEA medicine documentation (a departure, docs/results/nmt-domains.md)
FIVE_DOMAINS = ["news_wmt", "subtitles_opensubs", "ted_iwslt14", "software_it", "medical_emea"]


def _scale(
    task: dict[str, Any],
    *,
    pretrain_steps: int,
    pretrain_batch: int,
    pretrain_lr: float,
    pretrain_warmup: int,
    batch_size: int,
    pretrain_max_lines: int = 0,
    rounds: int = 5,
    max_steps: int = 0,
    per_domain_test: int = 0,
) -> dict[str, Any]:
    """One scale's settings; every scale pre-trains on news/WMT, its clients' Adam lr is 5e-4 and it pulls
    half and a third of the clients' parameters."""
    return dict(
        task=task,
        pretrain_domains=["news_wmt"],
        pretrain_max_lines=pretrain_max_lines,
        pretrain_steps=pretrain_steps,
        pretrain_batch=pretrain_batch,
        pretrain_lr=pretrain_lr,
        pretrain_warmup=pretrain_warmup,
        lr=5e-4,
        rounds=rounds,
        max_steps=max_steps,
        batch_size=batch_size,
        per_domain_test=per_domain_test,
        fractions=(0.5, 0.33),
    )


NMT_SETTINGS = {
    "paper": _scale(
        dict(model="base", domains=FIVE_DOMAINS, max_lines=0, vocab_size=32000, eval_max_sentences=0),
        pretrain_steps=100_000,
        pretrain_batch=64,
        pretrain_lr=7e-4,
        pretrain_warmup=4000,
        batch_size=64,
    ),
    "cpu": _scale(
        dict(
            model="mini",
            domains=FIVE_DOMAINS,
            max_lines=3000,
            vocab_size=4000,
            eval_max_sentences=40,
            max_len=64,
            dropout=0.0,
        ),
        pretrain_steps=4000,
        pretrain_batch=32,
        pretrain_lr=4e-3,
        pretrain_warmup=200,
        batch_size=24,
    ),
    "smoke": _scale(
        dict(
            model="tiny",
            domains=["news_wmt", "ted_iwslt14"],
            max_lines=60,
            vocab_size=300,
            eval_max_sentences=6,
        ),
        pretrain_max_lines=60,
        pretrain_steps=2,
        pretrain_batch=8,
        pretrain_lr=5e-4,
        pretrain_warmup=0,
        rounds=2,
        max_steps=1,
        batch_size=8,
        per_domain_test=3,
    ),
}


def nmt_train(s: dict[str, Any]) -> dict[str, Any]:
    """The clients' optimiser settings (a federation's and the local-only baselines')."""
    return dict(batch_size=s["batch_size"], lr=s["lr"], optimizer="adam", clip=1.0)


def nmt_options(scale: str, seed: int, cache: Path) -> dict[str, Any]:
    """The translation task's options at ``scale`` (one client per domain;
    the vocabulary cached under ``cache``)."""
    options = {
        **NMT_SETTINGS[scale]["task"],
        "data": corpus_folder("de-en"),
        "partition": "natural",
        "seed": seed,
        "cache_dir": str(cache / "spm-cache"),
    }
    return {k: v for k, v in options.items() if v is not None}


def nmt_specs(scale: str, options: dict[str, Any] | None = None) -> list[RunSpec]:
    """The federations of ``nmt-domains`` (one client per domain, C = 1): FedAvg, then DP_l / DP_g / random
    pulling at each of the scale's fractions."""
    s = NMT_SETTINGS[scale]
    options = options or {}
    job = dict(
        clients=len(s["task"]["domains"]),
        fraction=1.0,
        rounds=s["rounds"],
        epochs=1,
        max_steps=s["max_steps"],
        keep_checkpoints=s["rounds"],
        **DEADLINES,
        **SCHEDULE,
        **nmt_train(s),
    )
    specs = [
        RunSpec("fedavg", "nmt", options, {**job, "strategy": "fedavg"}, {"strategy": "fedavg", "pull": 1.0})
    ]
    for f in s["fractions"]:
        down = (
            f < 0.5
        )  # Passban et al.'s 33 % variant pulls in both directions (the server pushes a third too)
        for mode in ("pull-local", "pull-global", "pull-random"):
            specs.append(
                RunSpec(
                    f"{mode}-{f}" + ("-both" if down else ""),
                    "nmt",
                    options,
                    {**job, "strategy": mode, "pull_fraction": f, "pull_down": down},
                    {"strategy": mode, "pull": f, "directions": "both" if down else "up"},
                )
            )
    return specs
