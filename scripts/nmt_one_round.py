"""One FedAvg round of `nmt-domains` by hand, to see what averaging does to the clients' gains.

From the experiment's cached pre-trained engine (OUT/nmt-domains/pretrained.pt, written by
``fedmq experiment nmt-domains``), each client fine-tunes for one local epoch at each given learning rate, the
five models are averaged by the engine's FedAvg strategy (n_k weights), and the pre-trained engine, each
client and the average are scored on every domain's test pairs: sacreBLEU of greedy output and cross-entropy
(nats a token, teacher forcing). Prints one JSON line a model. An investigation (docs/results/nmt-domains.md),
not part of the experiment:

    python scripts/nmt_one_round.py runs/exp16 --lr 5e-4,1e-4 [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedmq.aggregator.strategies.base import ClientUpdate  # noqa: E402
from fedmq.aggregator.strategies.fedavg import FedAvg  # noqa: E402
from fedmq.benchmarks.experiments import ExperimentError, check_corpora  # noqa: E402
from fedmq.benchmarks.experiments.nmt_grid import NMT_SETTINGS, nmt_options, nmt_train  # noqa: E402
from fedmq.tasks.base import TrainConfig, load_state, model_state  # noqa: E402
from fedmq.tasks.nmt_domains import domain_bleu, domain_ce  # noqa: E402
from fedmq.tasks.registry import make_task  # noqa: E402


def scores(task, model) -> dict:
    bleu, ce = domain_bleu(task, model, "test"), domain_ce(task, model, "test")
    return {
        "bleu": {d: round(v, 2) for d, v in bleu.items()},
        "bleu_mean": round(sum(bleu.values()) / len(bleu), 3),
        "ce": {d: round(v, 3) for d, v in ce.items()},
        "ce_mean": round(sum(ce.values()) / len(ce), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the experiment's --out (holds nmt-domains/pretrained.pt)")
    ap.add_argument("--lr", default="5e-4", help="comma-separated client learning rates (Adam)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    cache = args.out / "nmt-domains"
    if not (cache / "pretrained.pt").is_file():
        print(
            f"error: {cache / 'pretrained.pt'} not found: run fedmq experiment nmt-domains --scale cpu first",
            file=sys.stderr,
        )
        return 2
    try:
        lrs = [float(x) for x in args.lr.split(",")]
    except ValueError:
        print(f"error: --lr wants comma-separated numbers, got {args.lr!r}", file=sys.stderr)
        return 2
    try:
        check_corpora("nmt-domains", "cpu")  # de-en in the data folder ($FEDMQ_DATA_DIR)
    except ExperimentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    task = make_task("nmt", **nmt_options("cpu", 0, cache))
    pretrained = torch.load(cache / "pretrained.pt", weights_only=True)
    model = task.build_model(0)
    load_state(model, pretrained)
    print(json.dumps({"model": "pre-trained", **scores(task, model)}), flush=True)
    for lr in lrs:
        fedavg = FedAvg()  # the engine's aggregation: n_k-weighted, folded client by client
        fedavg.begin(pretrained)
        for i, name in enumerate(task.shard_names):
            load_state(model, pretrained)
            result = task.train(
                model, i, TrainConfig(epochs=1, seed=0, **{**nmt_train(NMT_SETTINGS["cpu"]), "lr": lr})
            )
            print(json.dumps({"model": f"client {name}", "lr": lr, **scores(task, model)}), flush=True)
            fedavg.fold(ClientUpdate(client=name, n_samples=result.n_samples, tensors=model_state(model)))
        load_state(model, fedavg.finish())
        print(json.dumps({"model": "FedAvg of the five", "lr": lr, **scores(task, model)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
