"""The Flower 1.41 side of `fedmq bench flower`: the same task, run by Flower's Ray simulation.

Run by the driver (benchmarks/flower.py) in the venv that has ``flwr[simulation]==1.41.0`` (the ``bench``
extra), with the repository on PYTHONPATH so the task, model and local training are fedmq's own: the two
systems differ only in the framework around them. FedAvg, ``fraction_fit = C``, no federated evaluation
(fedmq evaluates on the server too: a centralized ``evaluate_fn`` on the same validation lines). Per round
it prints one JSON line: wall time from the previous round's end, and the bytes of the serialized
parameters Flower sent to and received from the fit clients (its ``Parameters.tensors``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", required=True, help="JSON of make_task options")
    ap.add_argument("--train", required=True, help="JSON of TrainConfig fields")
    ap.add_argument("--clients", type=int, required=True)
    ap.add_argument("--fraction", type=float, required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument(
        "--cpus-per-client", type=float, default=1.0
    )  # Ray CPUs per client actor: 1 runs twice as many actors side by side as Flower's default 2
    args = ap.parse_args(argv)

    from flwr.client import ClientApp, NumPyClient
    from flwr.common import Context, ndarrays_to_parameters
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    from fedmq.tasks.base import TrainConfig, load_state, model_state
    from fedmq.tasks.registry import make_task

    task_opts = json.loads(args.task)
    train = json.loads(args.train)
    task = make_task(task_opts.pop("task"), **task_opts)
    model = task.build_model(0)
    names = list(model_state(model))

    def to_arrays(m: torch.nn.Module) -> list[np.ndarray]:
        return [v.cpu().numpy() for v in model_state(m).values()]

    def set_arrays(m: torch.nn.Module, arrays: list[np.ndarray]) -> None:
        load_state(m, {k: torch.from_numpy(np.asarray(a)) for k, a in zip(names, arrays)})

    class LMClient(NumPyClient):
        def __init__(self, index: int) -> None:
            self.index = index

        def fit(self, parameters, config):
            set_arrays(model, parameters)
            result = task.train(model, self.index, TrainConfig(**train, seed=self.index))
            return to_arrays(model), result.n_samples, {"loss": result.loss}

    def client_fn(context: Context):
        return LMClient(int(context.node_config["partition-id"])).to_client()

    stats = {"last": time.time(), "down": 0}

    class Measured(FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):
            todo = super().configure_fit(server_round, parameters, client_manager)
            stats["down"] = sum(len(t) for _, ins in todo for t in ins.parameters.tensors)
            return todo

        def aggregate_fit(self, server_round, results, failures):
            up = sum(len(t) for _, res in results for t in res.parameters.tensors)
            out = super().aggregate_fit(server_round, results, failures)
            now = time.time()
            print(
                json.dumps(
                    {
                        "round": server_round,
                        "wall_s": now - stats["last"],
                        "bytes_down": stats["down"],
                        "bytes_up": up,
                        "received": len(results),
                        "failures": len(failures),
                    }
                ),
                flush=True,
            )
            stats["last"] = now
            return out

    def evaluate(server_round, parameters, config):
        set_arrays(model, parameters)
        return 0.0, {"valid": float(task.evaluate(model, "valid"))}

    def server_fn(context: Context) -> ServerAppComponents:
        m = max(int(args.fraction * args.clients), 1)
        strategy = Measured(
            fraction_fit=args.fraction,
            fraction_evaluate=0.0,
            min_fit_clients=m,
            min_available_clients=args.clients,
            evaluate_fn=evaluate,
            initial_parameters=ndarrays_to_parameters(to_arrays(model)),
        )
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=args.rounds))

    stats["last"] = time.time()
    run_simulation(
        server_app=ServerApp(server_fn=server_fn),
        client_app=ClientApp(client_fn=client_fn),
        num_supernodes=args.clients,
        backend_config={
            "client_resources": {"num_cpus": args.cpus_per_client, "num_gpus": 0.0},
            "init_args": {"num_cpus": 2, "include_dashboard": False},
        },
    )
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
