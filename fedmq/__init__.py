"""fedmq: message-queue based, asynchronous federated learning.

The public Python API, for bringing your own model, data and aggregation (docs/examples/bring_your_own.py)::

    import fedmq

    class MyTask(fedmq.Task): ...          # build_model, groups, num_clients, train, evaluate
    class MyStrategy(fedmq.Strategy): ...  # begin, fold, finish

    cfg = fedmq.JobConfig(job="mine", strategy="mypkg.mine:MyStrategy", rounds=5, clients=8, lr=0.1)
    summary = fedmq.Simulation(cfg, MyTask(), run_dir=Path("runs/mine")).run()

or from the command line, with the module on the Python path of every process that runs it::

    fedmq simulate --task mypkg.mine:MyTask --strategy mypkg.mine:MyStrategy
    fedmq aggregator run ... / fedmq agent run ...  (job.toml: strategy = "...", [task] task = "...")

The package itself is fedmq's shared bottom layer (errors, checks, the tensor manifest, tasks, the pulling
rule), which imports nothing else of the project; the names below are resolved on first use, so importing a
module of it (as the broker, the aggregator and the agent do) never loads the layers above.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    # what a task is made of (fedmq.tasks.base)
    "Task": "fedmq.tasks.base",
    "TrainConfig": "fedmq.train_config",
    "TrainResult": "fedmq.tasks.base",
    "Progress": "fedmq.tasks.base",
    "model_state": "fedmq.tasks.base",
    "load_state": "fedmq.tasks.base",
    "State": "fedmq.tasks.base",
    # what a strategy is made of (the aggregator's interface)
    "Strategy": "fedmq.aggregator.strategies.base",
    "ClientUpdate": "fedmq.aggregator.strategies.base",
    "RoundPlan": "fedmq.aggregator.strategies.base",
    "FedAvg": "fedmq.aggregator.strategies.fedavg",
    # a strategy's client side (fedmq.hooks)
    "ClientHook": "fedmq.hooks",
    "Kept": "fedmq.hooks",
    "RoundConfig": "fedmq.broker.wire.messages",
    # running a job
    "JobConfig": "fedmq.aggregator.config",
    "Simulation": "fedmq.simulation",
    "RunFolderInUse": "fedmq.simulation",
    # errors: one line for the user
    "FedmqError": "fedmq.errors",
    "StrategyError": "fedmq.errors",
    "BadParameter": "fedmq.errors",
    "TaskError": "fedmq.tasks.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fedmq' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
