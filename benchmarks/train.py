"""``fedmq bench train``: tokens/s of local training on CPU for the papers' models.

* GRU-small (tied, 300/300) and FedMed's LSTM (300 + 2x400, untied) on WikiText-2 with its full 33,278-word
  vocabulary, batch 20, BPTT 35, SGD lr 20, clip 0.25, dropout 0.2 (tokens = target tokens);
* the small Transformer (3+3 layers, d_model 256, 4 heads, FFN 1024) on de-en ``wmt_train_mix_opennmt``
  (first 5,000 pairs, shared BPE of 8,000), batch 32 pairs, Adam 5e-4, label smoothing 0.1 (tokens = target
  subword tokens incl. eos).

Each timed window is one ``Task.train`` call capped at ``steps`` optimizer steps (the real training path:
batching, forward, backward, clipping, step); after one warm-up window, the median tokens/s of ``repeats``
windows is reported. Torch runs with ``threads`` intra-op threads (default 1: the machine is shared).
Run: ``python -m fedmq.benchmarks.train [--quick] [--threads N]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fedmq.tasks.base import TrainConfig
from fedmq.tasks.corpora import find
from fedmq.tasks.registry import make_task


def _cases(data: Path | None) -> list[dict[str, Any]]:
    """The timed cases; ``data``: the folder that holds wikitext-2/ and de-en/ (None: the data folder,
    $FEDMQ_DATA_DIR; a corpus missing there is one line saying where to put it)."""

    def corpus(name: str) -> str:
        return str(data / name if data else find(name))

    lm_cfg = TrainConfig(batch_size=20, lr=20.0, clip=0.25)

    def lm(name: str, model: str, tied: bool) -> dict[str, Any]:
        options = dict(data=corpus("wikitext-2"), model=model, tied=tied, clients=1, dropout=0.2, bptt=35)
        return dict(name=name, corpus="wikitext-2", task="lm", cfg=lm_cfg, options=options)

    return [
        lm("gru-small (tied)", "gru-small", True),
        lm("lstm (untied)", "lstm", False),
        dict(
            name="transformer-small",
            corpus="de-en/wmt_train_mix_opennmt",
            task="nmt",
            cfg=TrainConfig(batch_size=32, lr=5e-4, optimizer="adam", clip=1.0),
            options=dict(
                data=corpus("de-en"),
                domains="wmt_train_mix_opennmt",
                model="small",
                max_lines=5000,
                vocab_size=8000,
                clients=1,
                partition="iid",
            ),
        ),
    ]


def bench_train(
    quick: bool = False, repeats: int = 5, steps: int = 20, threads: int = 1, data: str | Path | None = None
) -> list[dict[str, Any]]:
    if quick:
        repeats, steps = 2, 5
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as cache:
            for case in _cases(Path(data) if data else None):
                opts = dict(case["options"])
                if case["task"] == "nmt":
                    opts["cache_dir"] = cache
                t0 = time.perf_counter()
                task = make_task(case["task"], **opts)
                load_s = time.perf_counter() - t0
                model = task.build_model(0)
                cfg: TrainConfig = case["cfg"]
                task.train(model, 0, TrainConfig(**{**vars(cfg), "max_steps": 2}))  # warm-up
                rates, seconds = [], []
                for r in range(repeats):
                    res = task.train(model, 0, TrainConfig(**{**vars(cfg), "max_steps": steps, "seed": r}))
                    rates.append(res.tokens / res.seconds)
                    seconds.append(res.seconds / res.steps)
                rows.append(
                    {
                        "model": case["name"],
                        "corpus": case["corpus"],
                        "params": sum(p.numel() for p in model.parameters()),
                        "vocab": len(task.vocab),
                        "batch": cfg.batch_size,
                        "threads": threads,
                        "steps": steps,
                        "repeats": repeats,
                        "tokens_per_s": statistics.median(rates),
                        "min_tokens_per_s": min(rates),
                        "max_tokens_per_s": max(rates),
                        "s_per_step": statistics.median(seconds),
                        "load_s": load_s,
                    }
                )
    finally:
        torch.set_num_threads(old_threads)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | corpus | params | vocab | batch | threads | median tokens/s | min-max tokens/s | s/step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['corpus']} | {r['params'] / 1e6:.2f}M | {r['vocab']} | {r['batch']} | "
            f"{r['threads']} | {r['tokens_per_s']:,.0f} "
            f"| {r['min_tokens_per_s']:,.0f}-{r['max_tokens_per_s']:,.0f} "
            f"| {r['s_per_step']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", default=None)
    a = ap.parse_args()
    import sys

    sys.stdout.write(format_table(bench_train(a.quick, a.repeats, a.steps, a.threads, a.data)) + "\n")


if __name__ == "__main__":
    main()
