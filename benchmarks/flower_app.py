"""The Flower 1.41 side of `fedmq bench flower`: the same task, run by Flower's Ray simulation.

Written as Flower 1.41 documents its apps (the Message API: a ``ClientApp`` with a ``@train`` function,
a ``ServerApp`` whose ``@main`` runs ``flwr.serverapp.strategy.FedAvg.start``), and as a careful user
writes them:

* the task (corpus, vocabulary, shards) and the model are built once per process: once in each Ray actor,
  on its first message, kept in this module's cache, and once in the server; a message carries the
  parameters and a few short settings (the task's options as a JSON string), nothing else;
* each parameter once: the model's named parameters (``fedmq.tasks.base.model_state``), so the tied
  embedding/decoder matrix travels once, both ways;
* the apps are built by functions of this importable module and close over nothing large, so the ClientApp
  that Flower pickles into every message to an actor is a few kB: its functions find the task through this
  module's cache (a ClientApp whose functions close over a task and a model carries the whole corpus and
  model in every message).

FedAvg, ``fraction_train = C``, no federated evaluation; the server validates on the same lines as fedmq
(a centralized ``evaluate_fn``). Run by benchmarks/flower.py in the venv that has ``flwr[simulation]==1.41.0``
(the ``bench`` extra). Per round it prints one JSON line: ``start`` (``configure_train`` called), ``end``
(the round aggregated and validated: ``evaluate_fn`` returned), both ``time.time()``, and the bytes of the
arrays Flower sent to and received from the training clients. The driver's s/round is the period between
consecutive rounds' ``end``, the same interval it takes from fedmq's rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

_CACHE: dict[str, Any] = {}
_SETTINGS: dict[str, Any] = {}


def _task_and_model(task_json: str) -> tuple[Any, Any]:
    """This process's task and model for ``task_json``, built on first use."""
    got = _CACHE.get(task_json)
    if got is None:
        from fedmq.tasks.registry import make_task

        opts = json.loads(task_json)
        task = make_task(opts.pop("task"), **opts)
        got = _CACHE[task_json] = (task, task.build_model(0))
    return got


def _nbytes(record: Any) -> int:
    return sum(len(a.data) for a in record.values())


def _client_app() -> Any:
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        from fedmq.tasks.base import TrainConfig, load_state, model_state

        config = msg.content["config"]
        task, model = _task_and_model(str(config["task"]))
        client = int(context.node_config["partition-id"])
        load_state(model, msg.content["arrays"].to_torch_state_dict())
        result = task.train(model, client, TrainConfig(**json.loads(str(config["train"])), seed=client))
        content = RecordDict(
            {
                "arrays": ArrayRecord(torch_state_dict=model_state(model)),
                "metrics": MetricRecord({"train_loss": float(result.loss), "num-examples": result.n_samples}),
            }
        )
        return Message(content=content, reply_to=msg)

    return app


def _server_app() -> Any:
    from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    app = ServerApp()

    class Timed(FedAvg):
        """FedAvg that notes when each round starts and the bytes its messages carry."""

        def configure_train(self, server_round, arrays, config, grid):  # type: ignore[no-untyped-def]
            row = {"round": server_round, "start": time.time()}
            out = list(super().configure_train(server_round, arrays, config, grid))
            row["bytes_down"] = sum(_nbytes(m.content["arrays"]) for m in out)
            _SETTINGS["rows"].append(row)
            return out

        def aggregate_train(self, server_round, replies):  # type: ignore[no-untyped-def]
            replies = list(replies)
            row = _SETTINGS["rows"][-1]
            row["bytes_up"] = sum(_nbytes(r.content["arrays"]) for r in replies if r.has_content())
            row["received"] = sum(1 for r in replies if r.has_content())
            row["failures"] = sum(1 for r in replies if r.has_error())
            return super().aggregate_train(server_round, replies)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        from fedmq.tasks.base import load_state

        task, model = _task_and_model(_SETTINGS["task"])
        load_state(model, arrays.to_torch_state_dict())
        valid = float(task.evaluate(model, "valid"))
        if server_round > 0:
            row = _SETTINGS["rows"][-1]
            row["end"] = time.time()
            row["valid"] = valid
            print(json.dumps(row), flush=True)
        return MetricRecord({"valid": valid})

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        from fedmq.tasks.base import model_state

        s = _SETTINGS
        task, model = _task_and_model(s["task"])
        selected = max(int(s["fraction"] * s["clients"]), 1)
        strategy = Timed(
            fraction_train=s["fraction"],
            fraction_evaluate=0.0,
            min_train_nodes=selected,
            min_available_nodes=s["clients"],
        )
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(torch_state_dict=model_state(model)),
            num_rounds=s["rounds"],
            train_config=ConfigRecord({"task": s["task"], "train": s["train"]}),
            evaluate_fn=evaluate,
        )

    return app


def backend_config(cpus_per_client: float, cpus: int) -> dict[str, Any]:
    """The Ray backend's settings: ``cpus_per_client`` CPUs per client actor, ``cpus`` for Ray in all, and
    Ray's workers at the driver's priority (``worker_niceness`` 0): by default Ray renices them by +15, and on
    a busy machine Flower's clients would then train below fedmq's."""
    return {
        "client_resources": {"num_cpus": cpus_per_client, "num_gpus": 0.0},
        "init_args": {
            "num_cpus": cpus,
            "include_dashboard": False,
            "_system_config": {"worker_niceness": 0},
        },
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", required=True, help="JSON of make_task options")
    ap.add_argument("--train", required=True, help="JSON of TrainConfig fields")
    ap.add_argument("--clients", type=int, required=True)
    ap.add_argument("--fraction", type=float, required=True)
    ap.add_argument("--rounds", type=int, required=True)
    # Ray CPUs per client actor: 1 runs as many actors side by side as there are cores
    ap.add_argument("--cpus-per-client", type=float, default=1.0)
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="CPUs Ray may use")
    args = ap.parse_args(argv)
    from flwr.simulation import run_simulation

    _SETTINGS.update(
        task=json.dumps(json.loads(args.task), sort_keys=True),
        train=json.dumps(json.loads(args.train), sort_keys=True),
        clients=args.clients,
        fraction=args.fraction,
        rounds=args.rounds,
        rows=[],
    )
    run_simulation(
        server_app=_server_app(),
        client_app=_client_app(),
        num_supernodes=args.clients,
        backend_config=backend_config(args.cpus_per_client, args.cpus),
    )
    print(json.dumps({"done": True, "rounds": len(_SETTINGS["rows"])}), flush=True)


if __name__ == "__main__":
    # run through the importable module, so that the apps are pickled by reference (see the docstring)
    from fedmq.benchmarks import flower_app

    sys.exit(flower_app.main())
