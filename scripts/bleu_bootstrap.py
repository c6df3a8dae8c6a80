"""Paired bootstrap (Koehn 2004) of two `nmt-domains` servers' per-domain mean BLEU, on the test pairs the
experiment scores (``per_domain_test`` of each domain), seed by seed.

    python scripts/bleu_bootstrap.py runs/exp15/nmt-domains \\
        pull-local-0.33-both pull-global-0.33-both --seeds 0,1,2

Each resample draws every domain's test sentences with replacement (the same draw for both servers) and scores
sacreBLEU (13a, exponential smoothing, as ``corpus_bleu``) per domain from the sentences' summed statistics.
It prints, per seed and for the mean over seeds, A − B with its 95 % interval and the share of resamples where
A wins: how much of a difference between seeds' means the test set's own sampling could explain, which the
experiment's sd over seeds does not include (one test set serves every seed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from sacrebleu.metrics import BLEU

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedmq.benchmarks.experiments import ExperimentError, check_corpora, parse_seeds  # noqa: E402
from fedmq.benchmarks.experiments.nmt_grid import NMT_SETTINGS, nmt_options  # noqa: E402
from fedmq.tasks.base import load_state  # noqa: E402
from fedmq.tasks.nmt_domains import domain_pairs  # noqa: E402
from fedmq.tasks.registry import make_task  # noqa: E402

_BLEU = BLEU()


def sentence_stats(task, state: dict, pairs) -> np.ndarray:
    """One row of BLEU sufficient statistics per test pair (their column sums give the corpus score)."""
    model = task.build_model(0)
    load_state(model, state)
    hyps = task.translate(model, [p.src for p in pairs])
    return np.array(_BLEU._extract_corpus_statistics(hyps, [[p.tgt for p in pairs]]), dtype=np.int64)


def score(stats: np.ndarray) -> float:
    return _BLEU._compute_score_from_stats(stats.sum(0).tolist()).score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "exp_dir", type=Path, help="the experiment folder (holds spm-cache/ and seed-S/RUN/best.pt)"
    )
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--scale", default="cpu", choices=sorted(NMT_SETTINGS))
    parser.add_argument("--resamples", type=int, default=1000)
    args = parser.parse_args()
    try:
        seeds = parse_seeds(args.seeds)
        check_corpora("nmt-domains", args.scale)  # de-en in the data folder ($FEDMQ_DATA_DIR)
    except ExperimentError as exc:
        sys.exit(f"error: {exc}")
    if args.resamples < 1:
        sys.exit(f"error: --resamples must be at least 1, got {args.resamples}")
    runs = {}  # seed -> per domain (stats of A, stats of B)
    for seed in seeds:
        paths = [args.exp_dir / f"seed-{seed}" / run / "best.pt" for run in (args.run_a, args.run_b)]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            sys.exit(f"error: no best.pt at {', '.join(missing)}")
        task = make_task("nmt", **nmt_options(args.scale, seed, args.exp_dir))
        states = [torch.load(path, weights_only=True) for path in paths]
        runs[seed] = []
        for domain in task.corpus.domains:
            pairs = domain_pairs(task, domain, "test", NMT_SETTINGS[args.scale]["per_domain_test"])
            runs[seed].append(tuple(sentence_stats(task, state, pairs) for state in states))
    rng = np.random.default_rng(0)
    sizes = [len(a) for a, _ in runs[seeds[0]]]
    diffs = {seed: np.empty(args.resamples) for seed in seeds}
    for i in range(args.resamples):  # one draw of the test set, applied to every seed (they share it)
        draw = [rng.integers(0, size, size) for size in sizes]
        for seed in seeds:
            diffs[seed][i] = np.mean([score(a[idx]) for (a, _), idx in zip(runs[seed], draw)]) - np.mean(
                [score(b[idx]) for (_, b), idx in zip(runs[seed], draw)]
            )
    for seed in seeds:
        full = np.mean([score(a) - score(b) for a, b in runs[seed]])
        low, high = np.percentile(diffs[seed], [2.5, 97.5])
        print(
            f"seed {seed}: {args.run_a} - {args.run_b} = {full:+.2f}, 95 % [{low:+.2f}, {high:+.2f}], "
            f"A ahead in {np.mean(diffs[seed] > 0):.1%} of {args.resamples} resamples"
        )
    mean = np.mean([diffs[seed] for seed in seeds], axis=0)
    low, high = np.percentile(mean, [2.5, 97.5])
    print(f"mean over seeds: 95 % [{low:+.2f}, {high:+.2f}], A ahead in {np.mean(mean > 0):.1%} of resamples")


if __name__ == "__main__":
    main()
