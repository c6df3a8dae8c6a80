"""Trainers: the models local training runs on, shared by the agents of a process (Flower's ``client_fn`` idea).

An agent owns no model between rounds. When it is selected it borrows a trainer, loads the global model into
it, trains, encodes its update and gives the trainer back, so a process that simulates K clients holds
``size`` models, not K. A service agent (`fedmq agent run`) has a pool of one.

Each trainer's work runs on a thread of its own (``TrainerPool.run``): CUDA keeps state per thread (cuBLAS and
cuDNN handles and their workspaces, tens of MB each), so K agent threads that each trained on the GPU would hold
K sets of them — on an H100, eleven 100-client simulations ran out of its 80 GB by round 12.
"""

from __future__ import annotations

import contextlib
import contextvars
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterator, TypeVar

import torch

from fedmq.manifest import Manifest
from fedmq.tasks.base import Task

T = TypeVar("T")


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
        self._workers: dict[int, "queue.Queue[tuple[Callable[[], Any], Future]]"] = {}

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

    def run(self, model: torch.nn.Module, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the thread of the borrowed ``model`` (in the caller's logging context);
        returns its result or raises its exception."""
        with self._lock:
            jobs = self._workers.get(id(model))
            if jobs is None:
                jobs = self._workers[id(model)] = queue.Queue()
                threading.Thread(target=_serve, args=(jobs,), name=f"trainer-{len(self._workers)}", daemon=True).start()
        done: Future = Future()
        context = contextvars.copy_context()
        jobs.put((lambda: context.run(fn, *args, **kwargs), done))
        return done.result()


def _serve(jobs: "queue.Queue[tuple[Callable[[], Any], Future]]") -> None:
    while True:
        work, done = jobs.get()
        try:
            done.set_result(work())
        except BaseException as exc:  # handed to the caller, which raises it
            done.set_exception(exc)
