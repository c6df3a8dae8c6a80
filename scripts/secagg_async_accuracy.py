"""What secure asynchronous buffers cost in accuracy: the same asynchronous job (BufferedAsync) run in the
clear and under secure aggregation (`--secagg`: the whole protocol over the embedded broker, clients weighing
their own staleness), seed by seed, compared at the same number of folds (published versions).

.venv/bin/python scripts/secagg_async_accuracy.py --data ptb --seeds 0,1,2 [--versions 10] [--out DIR]

Raw encodings both ways in both arms (a secure job sends its quantized vector uncompressed). Asynchronous runs
are not bit-reproducible (the buffers' members depend on arrival order), so the plain arm's own spread from
seed to seed is printed beside the difference. Prints the final validation perplexity of each arm, mean ± sd
over the seeds, and the secure arm's change against the plain arm paired by seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ["--model", "gru-tiny", "-k", "10", "--strategy", "async", "--strategy-arg", "buffer_size=5"]
SETTINGS += ["--max-steps", "50", "--max-eval-lines", "500", "--encoding", "raw", "--down-encoding", "raw"]
# a constant learning rate: annealing on validation would tie each arm's later steps to its own early noise
SETTINGS += ["--lr-anneal", "1"]


def _run(data: str, seed: int, versions: int, out: Path, extra: list[str]) -> list[float]:
    """The validation perplexity after each published version of one run."""
    if not (out / "summary.json").is_file():
        cmd = [sys.executable, "-m", "fedmq.cli.app", "simulate", "--data", data, "--seed", str(seed)]
        cmd += [*SETTINGS, "-r", str(versions), *extra, "--out", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [float(r["valid"]) for r in rows if r.get("valid") is not None]


def _mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.2f} ± {sd:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="ptb")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--out", default="runs/secagg-async-accuracy")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    plain, secure = [], []
    for seed in seeds:
        plain.append(_run(args.data, seed, args.versions, out / f"plain-s{seed}", []))
        secure.append(_run(args.data, seed, args.versions, out / f"secure-s{seed}", ["--secagg"]))
    print(f"K = 10, buffer_size 5, {args.versions} versions, seeds {seeds}: validation perplexity")
    print("| folds | plain async | secure async | secure against plain, paired by seed |")
    print("|---|---|---|---|")
    for at in sorted({args.versions // 4, args.versions // 2, args.versions}):
        p = [run[at - 1] for run in plain]
        s = [run[at - 1] for run in secure]
        change = [100 * (b / a - 1) for a, b in zip(p, s)]
        print(f"| {at} | {_mean_sd(p)} | {_mean_sd(s)} | {_mean_sd(change)} % |")


if __name__ == "__main__":
    main()
