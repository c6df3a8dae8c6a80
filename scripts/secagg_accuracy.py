"""What secure aggregation's quantization costs in accuracy: a plain FedAvg job against the same job whose
clients send what a secure sum would carry (fedmq.secagg.clear_sum: clipped to [-c, c], weighted by
n_k / n_max, quantized to the b bits an m-client sum allows, decoded back), seed by seed.

.venv/bin/python scripts/secagg_accuracy.py --data ptb --seeds 0,1,2 --clip 1.0,0.05 [--lr 1.0] [--out DIR]

Each run is a `fedmq simulate` (raw encodings both ways in every arm, as a secure job sends its quantized
vector uncompressed); the strategy of the quantized arms is ``ClearSumFedAvg`` below, FedAvg with
``QuantizedUpload`` as its client side. Prints a table: the final validation perplexity of each arm, mean ± sd
over the seeds, and its change against the plain arm paired by seed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedmq.aggregator.strategies.fedavg import FedAvg  # noqa: E402
from fedmq.secagg.clear_sum import QuantizedUpload  # noqa: E402

K, FRACTION = 100, 0.1
SETTINGS = ["--model", "gru-tiny", "-k", str(K), "-c", str(FRACTION), "-r", "10", "--max-eval-lines", "500"]
SETTINGS += ["--encoding", "raw", "--down-encoding", "raw"]


class ClearSumFedAvg(FedAvg):
    """FedAvg whose clients upload what a secure sum of ``clients`` inputs would carry (module docstring)."""

    name: ClassVar[str] = "clear-sum-fedavg"
    client_hook = QuantizedUpload

    def __init__(self, clip: float = 1.0, clients: int = 20, max_samples: int = 1) -> None:
        super().__init__()
        self.clip, self.clients, self.max_samples = clip, clients, max_samples


def _largest_shard(data: str, clients: int, seed: int) -> int:
    """n_max: the most training tokens one client holds (so that no client's weight is capped)."""
    from fedmq.tasks.registry import make_task

    task = make_task("lm", data=data, model="gru-tiny", clients=clients, seed=seed)
    return max(len(task.client_ids(c)) for c in range(task.num_clients))


def _run(data: str, seed: int, lr: float, out: Path, strategy: list[str]) -> float:
    if not (out / "summary.json").is_file():
        cmd = [sys.executable, "-m", "fedmq.cli.app", "simulate", "--data", data, "--seed", str(seed)]
        cmd += [*SETTINGS, "--lr", str(lr), *strategy, "--out", str(out)]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent)}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, cwd=ROOT)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return float(rows[-1]["valid"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="ptb")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--clip", default="1.0,0.1", help="clipping ranges c to run, comma separated")
    ap.add_argument("--lr", type=float, default=1.0, help="the clients' learning rate")
    ap.add_argument("--out", default="runs/secagg-accuracy")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    clips = [float(c) for c in args.clip.split(",")]
    k, m = K, round(K * FRACTION)
    out = Path(args.out)
    arms: dict[str, list[float]] = {"plain": []}
    for seed in seeds:
        arms["plain"].append(_run(args.data, seed, args.lr, out / f"plain-s{seed}", ["--strategy", "fedavg"]))
        n_max = _largest_shard(args.data, k, seed)
        for c in clips:
            strategy = ["--strategy", "secagg_accuracy:ClearSumFedAvg"]
            for key, value in (("clip", c), ("clients", m), ("max_samples", n_max)):
                strategy += ["--strategy-arg", f"{key}={value}"]
            run = _run(args.data, seed, args.lr, out / f"c{c}-s{seed}", strategy)
            arms.setdefault(f"c = {c}", []).append(run)
    bits = 32 - math.ceil(math.log2(m))
    print(f"K = {k}, m = {m} a round ({bits} bits), lr {args.lr}, seeds {seeds}: validation perplexity")
    print("| arm | perplexity | against plain, paired by seed |")
    print("|---|---|---|")
    for arm, values in arms.items():
        change = [100 * (v / p - 1) for v, p in zip(values, arms["plain"])]
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        csd = statistics.stdev(change) if len(change) > 1 else 0.0
        print(
            f"| {arm} | {statistics.mean(values):.2f} ± {sd:.2f} | "
            + ("—" if arm == "plain" else f"{statistics.mean(change):+.2f} ± {csd:.2f} %")
            + " |"
        )


if __name__ == "__main__":
    main()
