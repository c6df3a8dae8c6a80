"""Tasks for tests/integration/test_clean_exit.py: local training that is still inside torch when a run ends.

``SlowTask``'s local training multiplies matrices (torch releases the GIL there, as in any real training) for
up to ``slow_s`` seconds, reporting progress after every step; the first ``fast`` trainings of the process
take ``fast_steps`` steps only (``fast``: the constructor's argument, else $EXIT_TASK_FAST, for a run of
`fedmq simulate`). A slow training that runs until its time is up prints ``TRAINED`` (a JSON log line) to
stderr, so a test tells a process that waited for its training from one that stopped it. Run with this
folder on the Python path: ``--task exit_tasks:SlowTask``.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import torch

import fedmq

TRAINED = json.dumps({"event": "slow training ran until its time was up"})


class SlowTask(fedmq.Task):
    name = "slow"
    metric = "accuracy"
    higher_is_better = True

    def __init__(
        self, clients: int = 4, seed: int = 0, fast: int | None = None, slow_s: float = 30.0
    ) -> None:
        self.clients, self.slow_s = clients, slow_s
        self.fast = int(os.environ.get("EXIT_TASK_FAST", "0")) if fast is None else fast
        self.fast_steps = 3
        self._trainings = itertools.count()
        self.x = torch.randn(64, 4, generator=torch.Generator().manual_seed(seed))

    def build_model(self, seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Linear(4, 2)

    def groups(self) -> dict[str, str]:
        return {name: "model" for name, _ in self.build_model().named_parameters()}

    @property
    def num_clients(self) -> int:
        return self.clients

    def train(
        self,
        model: torch.nn.Module,
        client: int,
        cfg: fedmq.TrainConfig,
        progress: fedmq.Progress | None = None,
    ) -> fedmq.TrainResult:
        fast = next(self._trainings) < self.fast
        t0, steps, a = time.perf_counter(), 0, torch.randn(256, 256)
        while (steps < self.fast_steps) if fast else (time.perf_counter() - t0 < self.slow_s):
            a = torch.tanh(a @ a)  # long enough (~1 ms) for the thread to be inside torch most of the time
            with torch.no_grad():
                model.bias.add_(1e-3)
            steps += 1
            if progress is not None:
                progress(steps, 0)
        if not fast:
            print(TRAINED, file=sys.stderr, flush=True)
        return fedmq.TrainResult(
            loss=1.0, n_samples=64, steps=steps, tokens=64, seconds=time.perf_counter() - t0
        )

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, split: str = "valid") -> float:
        return float((model(self.x).argmax(1) == 0).float().mean())
