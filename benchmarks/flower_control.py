"""A minimal Flower 1.41 harness of the `fedmq bench flower` round: the control its Flower side is checked
against (tests/integration/test_flower_control.py: their s/round agree within ±20 %).

Written apart from benchmarks/flower_app.py and sharing none of its code: Flower's classic API
(``NumPyClient``, ``flwr.server.strategy.FedAvg``, ``ServerApp(server_fn=...)``) where the bench uses the
Message API. Only fedmq's task (model, data, local training step) is common to both, as it is to fedmq's own
run. Each Ray actor builds the task and the model once (a module-level cache); the client exchanges the
model's named parameters as NumPy arrays (a tied matrix once). The server validates after every round
(``evaluate_fn``), and each round prints ``{"round", "end"}``: the time ``evaluate_fn`` returned; s/round is
the period between consecutive ends.

    python -m fedmq.benchmarks.flower_control --task JSON --train JSON --clients K --fraction C --rounds R
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

_built: dict = {}


def _built_once(task_json: str):  # type: ignore[no-untyped-def]
    if task_json not in _built:
        from fedmq.tasks.registry import make_task

        opts = json.loads(task_json)
        task = make_task(opts.pop("task"), **opts)
        _built[task_json] = (task, task.build_model(0))
    return _built[task_json]


def _get(model: torch.nn.Module) -> list[np.ndarray]:
    return [p.detach().cpu().numpy() for _, p in model.named_parameters()]


def _set(model: torch.nn.Module, arrays: list[np.ndarray]) -> None:
    with torch.no_grad():
        for (_, p), a in zip(model.named_parameters(), arrays):
            p.copy_(torch.from_numpy(np.asarray(a)))


def client_fn(context):  # type: ignore[no-untyped-def]
    from flwr.client import NumPyClient

    from fedmq.tasks.base import TrainConfig

    class Client(NumPyClient):
        def fit(self, parameters, config):  # type: ignore[no-untyped-def]
            task, model = _built_once(str(config["task"]))
            cid = int(context.node_config["partition-id"])
            _set(model, parameters)
            res = task.train(model, cid, TrainConfig(**json.loads(str(config["train"])), seed=cid))
            return _get(model), res.n_samples, {"loss": float(res.loss)}

    return Client().to_client()


def backend_config() -> dict:
    """One CPU per client actor, every core for Ray, and Ray's workers not reniced (Ray's default is +15:
    they would train below the bench's)."""
    return {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {
            "num_cpus": os.cpu_count() or 1,
            "include_dashboard": False,
            "_system_config": {"worker_niceness": 0},
        },
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--clients", type=int, required=True)
    ap.add_argument("--fraction", type=float, required=True)
    ap.add_argument("--rounds", type=int, required=True)
    a = ap.parse_args(argv)

    from flwr.client import ClientApp
    from flwr.common import Context, ndarrays_to_parameters
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    task, model = _built_once(a.task)

    def evaluate(rnd, parameters, config):  # type: ignore[no-untyped-def]
        _set(model, parameters)
        valid = float(task.evaluate(model, "valid"))
        if rnd > 0:
            print(json.dumps({"round": rnd, "end": time.time(), "valid": valid}), flush=True)
        return 0.0, {"valid": valid}

    def server_fn(context: Context) -> ServerAppComponents:
        per_round = max(int(a.fraction * a.clients), 1)
        strategy = FedAvg(
            fraction_fit=a.fraction,
            fraction_evaluate=0.0,
            min_fit_clients=per_round,
            min_available_clients=a.clients,
            evaluate_fn=evaluate,
            on_fit_config_fn=lambda rnd: {"task": a.task, "train": a.train},
            initial_parameters=ndarrays_to_parameters(_get(model)),
        )
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=a.rounds))

    run_simulation(
        server_app=ServerApp(server_fn=server_fn),
        client_app=ClientApp(client_fn=client_fn),
        num_supernodes=a.clients,
        backend_config=backend_config(),
    )


if __name__ == "__main__":
    from fedmq.benchmarks import flower_control

    sys.exit(flower_control.main())
