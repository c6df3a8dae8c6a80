"""``fedmq bench cohort``: a round's local training,
the selected clients one after the other vs as one cohort.

The paper scale's client: the corpus with its full vocabulary split into K iid shards, GRU-small tied (or any
preset), the paper-scale LM experiments' SGD (grids.lm_client: lr 0.5, momentum 0.5, B = 10, no clipping),
BPTT 35, dropout 0.2, E epochs (``max_steps`` caps a client's steps, for a
CPU). For each cohort size n, clients 0..n-1 train from the same model, first alone (``Task.train`` each, what
a simulation with one trainer does) and then together (``Task.train_cohort``); each is timed ``repeats`` times
and the medians are reported with their ratio, the largest parameter difference between the two results (the
float summation order: it should stay near 1e-5) and, on CUDA, the peak GPU memory of the cohort. Run: ``fedmq
bench cohort --data ptb --cohort 10,50 --device cuda``.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fedmq.benchmarks.experiments.grids import lm_client
from fedmq.tasks.base import TrainConfig, model_state
from fedmq.tasks.registry import make_task
from fedmq.tasks.training import resolve_device


def bench_cohort(
    data: str | Path,
    model: str = "gru-small",
    clients: int = 100,
    sizes: tuple[int, ...] = (10,),
    epochs: int = 5,
    max_steps: int = 0,
    device: str = "cpu",
    repeats: int = 3,
    threads: int = 1,
) -> list[dict[str, Any]]:
    torch.set_num_threads(threads)
    dev = resolve_device(device)
    task = make_task("lm", data=str(data), model=model, clients=clients, dropout=0.2, seed=0)
    start = task.build_model(0)
    rows = []
    for n in sizes:
        picked = list(range(n))
        client = lm_client("paper")
        cfgs = [
            TrainConfig(**client, epochs=epochs, max_steps=max_steps, device=device, seed=c) for c in picked
        ]
        alone_s, together_s, diff, tokens, peak = _time(task, start, picked, cfgs, dev, repeats)
        a, t = statistics.median(alone_s), statistics.median(together_s)
        rows.append(
            {
                "corpus": Path(data).name,
                "model": model,
                "vocab": len(task.vocab),
                "clients": clients,
                "cohort": n,
                "epochs": epochs,
                "max_steps": max_steps,
                "device": str(dev),
                "threads": threads,
                "tokens": tokens,
                "repeats": repeats,
                "alone_s": a,
                "together_s": t,
                "speedup": a / t,
                "max_param_diff": diff,
                "peak_gpu_mb": peak / 2**20 if peak else None,
            }
        )
    return rows


def _time(
    task: Any,
    start: torch.nn.Module,
    picked: list[int],
    cfgs: list[TrainConfig],
    dev: torch.device,
    repeats: int,
) -> tuple[list[float], list[float], float, int, int]:
    """The cohort's clients trained one after the other, then together, ``repeats`` times after a warm-up:
    the seconds of each way, the largest parameter difference between them, the tokens trained and the
    peak GPU memory."""
    n = len(picked)
    alone_s, together_s, diff, tokens, peak = [], [], 0.0, 0, 0
    for r in range(repeats + 1):  # the first of each is a warm-up (CUDA kernels, caches), not timed
        alone = [copy.deepcopy(start) for _ in picked]
        t0 = time.perf_counter()
        results = [task.train(m, c, cfg) for m, c, cfg in zip(alone, picked, cfgs)]
        _sync(dev)
        t1 = time.perf_counter()
        together = [copy.deepcopy(start) for _ in picked]
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t2 = time.perf_counter()
        task.train_cohort(together, picked, cfgs, [None] * n)
        _sync(dev)
        t3 = time.perf_counter()
        if r:
            alone_s.append(t1 - t0)
            together_s.append(t3 - t2)
        diff = max(diff, _max_diff(alone, together))
        tokens = sum(res.tokens for res in results)
        if dev.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated(dev))
    return alone_s, together_s, diff, tokens, peak


def _max_diff(alone: list[torch.nn.Module], together: list[torch.nn.Module]) -> float:
    """The largest difference of any parameter between the models trained alone and together."""
    return max(
        float((a - b).abs().max())
        for x, y in zip(alone, together)
        for a, b in zip(model_state(x).values(), model_state(y).values())
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| corpus | model | vocab | cohort | E | step cap | device | tokens | alone s (median) | together s "
        "(median) | alone ÷ together | max param diff | peak GPU MB |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        peak = f"{r['peak_gpu_mb']:,.0f}" if r["peak_gpu_mb"] else "–"
        lines.append(
            f"| {r['corpus']} | {r['model']} | {r['vocab']} | {r['cohort']} | {r['epochs']} | "
            f"{r['max_steps'] or '–'} | {r['device']} ({r['threads']} threads) | {r['tokens']:,} | "
            f"{r['alone_s']:.2f} | {r['together_s']:.2f} | {r['speedup']:.2f} | {r['max_param_diff']:.1e} | "
            f"{peak} |"
        )
    return "\n".join(lines)
