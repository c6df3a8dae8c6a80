"""Trainers: the models local training runs on, shared by the agents of a process (Flower's ``client_fn`` idea).

An agent owns no model between rounds. When it is selected it borrows a trainer, loads the global model into
it, trains, encodes its update and gives the trainer back, so a process that simulates K clients holds
``size`` models, not K. A service agent (`fedmq agent run`) has a pool of one.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Iterator

import torch

from fedmq.manifest import Manifest
from fedmq.tasks.base import Task


class TrainerPool:
    """``size`` models of ``task``, built on first use (one is built at once for the manifest)."""

    def __init__(self, task: Task, size: int = 1, seed: int = 0) -> None:
        if size < 1:
            raise ValueError("a trainer pool needs at least one trainer")
        self.task, self.size, self.seed = task, size, seed
        first = task.build_model(seed)
        self.manifest: Manifest = task.manifest(first)
        self.groups = task.groups()
        self._free: "queue.Queue[torch.nn.Module]" = queue.Queue()
        self._free.put(first)
        self._built = 1
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def borrow(self) -> Iterator[torch.nn.Module]:
        """A model to train on, exclusively until the block ends (waits while all are borrowed)."""
        with self._lock:
            if self._free.empty() and self._built < self.size:
                self._free.put(self.task.build_model(self.seed))
                self._built += 1
        model = self._free.get()
        try:
            yield model
        finally:
            self._free.put(model)
