"""``fedmq bench aggregate``: streaming aggregation throughput and peak RSS vs stacking all updates.

Every (method, count) pair runs in a fresh subprocess so its peak RSS (``ru_maxrss``) is its own. Updates
are generated on the fly into one reusable model-sized buffer from a seeded generator (untimed), so
memory and time measure the aggregator, not a pile of pre-made updates. Methods:

* ``inplace``       plain in-place weighted sum ``acc.add_(x_k, alpha=n_k)`` then ``/ n`` (the yardstick)
* ``fedavg``        aggregator.strategies.fedavg.FedAvg folding updates as deltas Δ_k = θ_k − θ, as the engine
                    hands them over (validation + the same sum; θ is added once in ``finish``)
* ``fedatt``        aggregator.strategies.fedatt.FedAtt on deltas ('fro' distance ‖Δ_k‖ + running log-sum-exp)
* ``fedavg-full``, ``fedatt-full``  the same strategies given full weights θ_k (FedAtt's distance ‖θ − θ_k‖
                    then reads θ as well as θ_k)
* ``stack-fedavg``  copy every update into a [K, numel] stack per tensor, then one weighted reduction
* ``stack-fedatt``  the same stack, all distances (same chunked kernel as FedAtt), softmax, one weighted
                    reduction

The yardstick sums tensors of the same size as every method folds (the deltas' or the weights' values do
not change its cost).

The stacking baselines are skipped where K models would exceed ``stack_budget_gb`` (default 8 GB: the
machine is shared) — at 25M parameters that is 200 updates (20 GB). Throughput = K × model bytes /
(time of all folds + finish). Torch runs single-threaded for stable numbers on a shared machine.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("inplace", "fedavg", "fedatt", "fedavg-full", "fedatt-full", "stack-fedavg", "stack-fedatt")
STRATEGY_METHODS = ("fedavg", "fedatt", "fedavg-full", "fedatt-full")


def model_shapes(params: int) -> dict[str, tuple[int, ...]]:
    """A language-model-like mix: a big embedding, square 1024×1024 matrices with biases, a filler vector."""
    shapes: dict[str, tuple[int, ...]] = {}
    rows = int(0.4 * params) // 512
    if rows:
        shapes["embedding"] = (rows, 512)
    left = params - rows * 512
    for i in range(int(0.4 * params) // (1024 * 1024 + 1024)):
        shapes[f"layer{i}.weight"] = (1024, 1024)
        shapes[f"layer{i}.bias"] = (1024,)
        left -= 1024 * 1024 + 1024
    if left > 0:
        shapes["out.bias"] = (left,)
    return shapes


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


# a worker's fold of ``count`` arriving updates: the aggregate, each fold's seconds and finish's
Folded = tuple[dict[str, Any], list[float], float]


def _fold_strategy(method: str, glob: dict, buf: dict, weights: list[int], next_update: Callable) -> Folded:
    """FedAvg's or FedAtt's own fold (STRATEGY_METHODS)."""
    from fedmq.aggregator.strategies.base import ClientUpdate
    from fedmq.aggregator.strategies.fedatt import FedAtt
    from fedmq.aggregator.strategies.fedavg import FedAvg

    fold_times: list[float] = []
    as_delta = method in ("fedavg", "fedatt")
    strat = FedAvg() if method.startswith("fedavg") else FedAtt()
    strat.begin(glob)
    for i in range(len(weights)):
        next_update()
        u = ClientUpdate(str(i), weights[i], buf, delta=as_delta)
        t0 = time.perf_counter()
        strat.fold(u)
        fold_times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    out = strat.finish()
    return out, fold_times, time.perf_counter() - t0


def _fold_inplace(shapes: dict, buf: dict, weights: list[int], next_update: Callable) -> Folded:
    """A weighted sum kept in place, divided at the end."""
    import torch

    fold_times: list[float] = []
    acc = {k: torch.zeros(s) for k, s in shapes.items()}
    for i in range(len(weights)):
        next_update()
        t0 = time.perf_counter()
        for k, t in buf.items():
            acc[k].add_(t, alpha=weights[i])
        fold_times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    out = {k: a.div_(sum(weights)) for k, a in acc.items()}
    return out, fold_times, time.perf_counter() - t0


def _fold_stacked(method: str, glob: dict, buf: dict, weights: list[int], next_update: Callable) -> Folded:
    """Every update kept in a stack, reduced at the end (stack-fedavg, or FedAtt's attention otherwise)."""
    import torch

    from fedmq.aggregator.strategies._common import sq_distance

    count = len(weights)
    fold_times: list[float] = []
    stacks = {k: torch.empty((count, t.numel())) for k, t in glob.items()}
    for i in range(count):
        next_update()
        t0 = time.perf_counter()
        for k, t in buf.items():
            stacks[k][i].copy_(t.reshape(-1))
        fold_times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    out = {}
    for k, st in stacks.items():
        if method == "stack-fedavg":
            w = torch.tensor(weights, dtype=torch.float32) / sum(weights)
        else:
            d = torch.tensor([sq_distance(glob[k], row) for row in st], dtype=torch.float64).sqrt()
            w = torch.softmax(d, 0).float()
        red = w @ st
        out[k] = (
            red.reshape(glob[k].shape)
            if method == "stack-fedavg"
            else (glob[k] - 1.2 * (glob[k] - red.reshape(glob[k].shape)))
        )
    return out, fold_times, time.perf_counter() - t0


def _worker(method: str, count: int, params: int, seed: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    base_rss = _rss_mb()
    gen = torch.Generator().manual_seed(seed)
    shapes = model_shapes(params)
    glob = {k: torch.empty(s).uniform_(-0.1, 0.1, generator=gen) for k, s in shapes.items()}
    buf = {k: torch.empty(s) for k, s in shapes.items()}  # the one reusable "arriving update"
    model_bytes = sum(t.numel() * 4 for t in glob.values())

    as_delta = method in ("fedavg", "fedatt")

    def next_update() -> None:  # untimed: the harness, not the aggregator
        for k, t in buf.items():
            t.uniform_(-0.01, 0.01, generator=gen)
            if not as_delta:
                t.add_(glob[k])

    weights = [1 + (i % 7) for i in range(count)]
    if method in STRATEGY_METHODS:
        out, fold_times, t_finish = _fold_strategy(method, glob, buf, weights, next_update)
    elif method == "inplace":
        out, fold_times, t_finish = _fold_inplace(shapes, buf, weights, next_update)
    else:
        out, fold_times, t_finish = _fold_stacked(method, glob, buf, weights, next_update)
    total = sum(fold_times) + t_finish
    fold_times.sort()
    assert all(bool(torch.isfinite(v).all()) for v in out.values())
    peak = _rss_mb()
    return {
        "method": method,
        "count": count,
        "params": params,
        "model_mb": model_bytes / 2**20,
        "gb_s": count * model_bytes / total / 1e9,
        "median_fold_ms": fold_times[len(fold_times) // 2] * 1e3,
        "finish_ms": t_finish * 1e3,
        "peak_rss_mb": peak,
        "base_rss_mb": base_rss,
        "rss_over_base_models": (peak - base_rss) / (model_bytes / 2**20),
    }


def _run_subprocess(method: str, count: int, params: int, seed: int) -> dict[str, Any]:
    arg = json.dumps({"method": method, "count": count, "params": params, "seed": seed})
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", arg],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"method": method, "count": count, "params": params, "error": tail}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_aggregate(
    counts: tuple[int, ...] = (10, 50, 200),
    params: int = 25_000_000,
    methods: tuple[str, ...] = METHODS,
    stack_budget_gb: float = 8.0,
    seed: int = 0,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """One row per (count, method). With ``repeats`` > 1 the methods run in turn, ``repeats`` rounds, and each
    number is the median over the rounds; "vs inplace" is the median of the per-round ratios, so a load
    change on a shared machine hits both sides of a ratio alike."""
    rows = []
    for count in counts:
        need_gb = count * params * 4 / 1e9
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
        for _ in range(repeats):
            for method in methods:
                if method.startswith("stack") and need_gb > stack_budget_gb:
                    continue
                runs[method].append(_run_subprocess(method, count, params, seed))
        base = runs.get("inplace", [])
        for method in methods:
            if method.startswith("stack") and need_gb > stack_budget_gb:
                rows.append(
                    {
                        "method": method,
                        "count": count,
                        "params": params,
                        "skipped": f"stack needs {need_gb:.0f} GB > budget {stack_budget_gb:g} GB",
                    }
                )
                continue
            good = [r for r in runs[method] if "gb_s" in r]
            if len(good) < len(runs[method]):
                rows.append(next(r for r in runs[method] if "gb_s" not in r))
                continue
            row = {
                **good[0],
                "repeats": len(good),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in good),
                "rss_over_base_models": max(r["rss_over_base_models"] for r in good),
            }
            for key in ("gb_s", "median_fold_ms", "finish_ms"):
                row[key] = statistics.median(r[key] for r in good)
            ratios = [r["gb_s"] / b["gb_s"] for r, b in zip(good, base) if "gb_s" in b]
            if ratios:
                row["vs_inplace"] = statistics.median(ratios)
            rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'method':<13} {'updates':>7} {'GB/s':>6} {'vs inplace':>10} {'fold ms (med)':>13} "
        f"{'finish ms':>9} {'peak RSS MB':>11} {'(RSS-base)/model':>16}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "gb_s" not in r:
            lines.append(
                f"{r['method']:<13} {r['count']:>7}  {r.get('skipped') or 'error: ' + r.get('error', '?')}"
            )
            continue
        lines.append(
            f"{r['method']:<13} {r['count']:>7} {r['gb_s']:>6.2f} {r.get('vs_inplace', float('nan')):>10.2f} "
            f"{r['median_fold_ms']:>13.1f} {r['finish_ms']:>9.1f} {r['peak_rss_mb']:>11.0f} "
            f"{r['rss_over_base_models']:>16.2f}"
        )
    if rows and "model_mb" in next((r for r in rows if "model_mb" in r), {}):
        r0 = next(r for r in rows if "model_mb" in r)
        lines.append(
            f"model: {r0['params']:,} float32 parameters = {r0['model_mb']:.0f} MiB; "
            f"base RSS (interpreter + torch) ≈ {r0['base_rss_mb']:.0f} MiB; "
            "the harness itself holds 2 models (θ_r and the arriving update)."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker")
    ap.add_argument("--counts", default="10,50,200")
    ap.add_argument("--params", type=int, default=25_000_000)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--repeats", type=int, default=1, help="run the methods in turn this many times; report medians"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.worker:
        spec = json.loads(args.worker)
        sys.stdout.write(json.dumps(_worker(**spec)) + "\n")
        return
    rows = bench_aggregate(
        tuple(int(c) for c in args.counts.split(",")),
        args.params,
        tuple(args.methods.split(",")),
        repeats=args.repeats,
    )
    sys.stdout.write((json.dumps(rows, indent=1) if args.json else format_table(rows)) + "\n")


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    main()
