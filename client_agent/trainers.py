"""Trainers: the models local training runs on, shared by the agents of a process
(Flower's ``client_fn`` idea).

An agent owns no model between rounds. When it is selected it fetches and decodes the global model, borrows a
trainer, loads the model into it, trains, encodes its update and gives the trainer back, so a process that
simulates K clients holds ``size`` models, not K. A service agent (`fedmq agent run`) has a pool of one.

The pool also paces what comes before a trainer: an agent decodes its round's global model before it borrows
(``ahead``: at most ``size + 1`` at once, the trainers' clients and one decoding while they train), and the
agents of one process that take the same form of the same version share one decode (``shared_decode``).

Each trainer's work runs on a thread of its own (``TrainerPool.run``): CUDA keeps state per thread (cuBLAS and
cuDNN handles and their workspaces, tens of MB each), so K agent threads that each trained on the GPU would
hold K sets of them — on an H100, eleven 100-client simulations ran out of its 80 GB by round 12.

A ``CohortPool`` (``fedmq simulate --cohort``) trains its borrowers together: the agents a round selected each
hand in their job, and once every selected agent has handed in its job or dropped out of the round, one
``Task.train_cohort`` call trains them all (for the RNN language models, one batched model on the GPU:
fedmq.tasks.lm_cohort). Each agent still fetches, trains on its own shard, encodes and uploads its own update;
only the arithmetic of local training is shared. The pool learns who is coming from the round's announcement
(``taking_part``), not from who has borrowed a model yet: on a loaded machine agents reach ``borrow`` seconds
apart (a paper-scale round on a busy CPU trained 3 of its 10 clients as a cohort when it waited for borrowers:
the other 7 were, most likely, waiting for their models to be built).
"""

from __future__ import annotations

import contextlib
import contextvars
import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog
import torch

from fedmq.manifest import Manifest
from fedmq.tasks.base import Progress, Task, TrainConfig, TrainResult

log = structlog.get_logger(__name__)

T = TypeVar("T")
_PART: contextvars.ContextVar[str | None] = contextvars.ContextVar("taking_part", default=None)
CLOSED = "the run is over: its trainers are closed"
# shared decodes kept: a version's shareable forms (full, pull-down partial; a delta is decoded onto each
# client's own base, never shared) and one to spare, so a newer version does not evict one still being read
SHARED_FORMS = 3


class PoolClosed(RuntimeError):
    """The pool's run is over: borrowing, training or work queued on a trainer thread ends with this (an agent
    still at work when its run ended). Local training that is running stops at its next step."""


class TrainerPool:
    """``size`` models of ``task``, built on first use (one is built at once for the manifest)."""

    def __init__(self, task: Task, size: int = 1, seed: int = 0) -> None:
        if size < 1:
            raise ValueError("a trainer pool needs at least one trainer")
        self.task, self.size, self.seed = task, size, seed
        first = task.build_model(seed)
        self.manifest: Manifest = task.manifest(first)
        self.groups = task.groups()
        self._free: queue.Queue[torch.nn.Module] = queue.Queue()
        self._free.put(first)
        self._built = 1
        self._open = True
        self._lock = threading.Condition()  # guards the models, the workers and _busy; told of every change
        self._busy = 0  # work handed to the trainer threads (or a cohort's) and not finished
        self._workers: dict[int, queue.Queue[tuple[Callable[[], Any], Future]]] = {}
        self._ahead = _TurnGate(size + 1)
        self._decoding = threading.Lock()  # one shared decode at a time: the others wait and take it
        self._decoded: dict[Hashable, Any] = {}  # key -> value, the newest SHARED_FORMS shared decodes
        self._inside = 0  # agents between fetching their model and the end of their training

    @contextlib.contextmanager
    def ahead(self, turn: tuple[Any, ...] = ()) -> Iterator[None]:
        """From fetching the round's global model to the end of local training: the next client decodes while
        the trainers train, and no more than ``size + 1`` decoded models wait (a delta form is decoded
        onto the client's own base, so it is not shared). When the last agent leaves, the shared decodes go:
        between rounds the process keeps no model. PoolClosed once the pool is closed.

        Waiting agents go in by ``turn``, smallest first (an agent passes its round and name: the order in
        which a synchronous round folds its updates), not in the order their threads happened to come: a
        round's updates then arrive about in fold order, rather than most of them ahead of their turn and
        parked on the aggregator's spool (1,972 of 2,000 in a simulation of m = 1,000 before)."""
        with self._ahead.slot(turn):
            with self._lock:
                if not self._open:
                    raise PoolClosed(CLOSED)
                self._inside += 1
            try:
                yield
            finally:
                with self._lock:
                    self._inside -= 1
                    if self._inside == 0:
                        self._decoded = {}

    def shared_decode(self, key: Hashable, decode: Callable[[], T]) -> T:
        """``decode()``, once for the agents inside ``ahead`` that ask for the same ``key`` (a model message
        and the tensors read from it), among the newest SHARED_FORMS keys. The value is shared: nobody may
        change it (fedmq.hooks.ClientHook.start)."""
        with self._decoding:
            with self._lock:
                if key in self._decoded:
                    return self._decoded[key]
            value = decode()
            with self._lock:
                if self._open and self._inside:
                    self._decoded[key] = value
                    while len(self._decoded) > SHARED_FORMS:
                        del self._decoded[next(iter(self._decoded))]
            return value

    @contextlib.contextmanager
    def borrow(self) -> Iterator[torch.nn.Module]:
        """A model to train on, exclusively until the block ends (waits while all are borrowed).
        PoolClosed once the pool is closed, also to a borrower still waiting then."""
        with self._lock:
            while True:
                if not self._open:
                    raise PoolClosed(CLOSED)
                if not self._free.empty():
                    model = self._free.get_nowait()
                    break
                if self._built < self.size:
                    model = self.task.build_model(self.seed)
                    self._built += 1
                    break
                self._lock.wait()
        try:
            yield model
        finally:
            with self._lock:
                if self._open:  # a model given back after close (its agent outlived the run) is let go too
                    self._free.put(model)
                    self._lock.notify()

    @contextlib.contextmanager
    def taking_part(self, round_number: int, selected: Sequence[str], agent: str) -> Iterator[None]:
        """``agent``'s part in round ``round_number``, which selected ``selected``: from its announcement to
        the end of its training, however it ends. Nothing to a pool whose trainers work alone
        (CohortPool's)."""
        yield

    def train(
        self, model: torch.nn.Module, client: int, cfg: TrainConfig, progress: Progress | None = None
    ) -> TrainResult:
        """Local training of ``client`` on the borrowed ``model``, on the model's thread; it stops at its next
        step (PoolClosed) when the pool is closed."""
        return self.run(model, self.task.train, model, client, cfg, progress=self._checked(progress))

    def _checked(self, progress: Progress | None) -> Progress:
        """``progress`` that first ends the training (PoolClosed) once the pool is closed."""

        def report(done: int, total: int) -> None:
            if not self._open:
                raise PoolClosed(CLOSED)
            if progress is not None:
                progress(done, total)

        return report

    def run(self, model: torch.nn.Module, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the thread of the borrowed ``model`` (in the caller's logging context);
        returns its result or raises its exception (PoolClosed if the pool was closed before it started)."""
        with self._lock:
            if not self._open:
                raise PoolClosed(CLOSED)
            jobs = self._workers.get(id(model))
            if jobs is None:
                jobs = self._workers[id(model)] = queue.Queue()
                threading.Thread(
                    target=_serve, args=(jobs,), name=f"trainer-{len(self._workers)}", daemon=True
                ).start()
            self._busy += 1
        done: Future = Future()
        context = contextvars.copy_context()

        def work() -> T:
            try:
                if not self._open:  # queued behind work that was running when the run ended
                    raise PoolClosed(CLOSED)
                return context.run(fn, *args, **kwargs)
            finally:
                self._finished()

        jobs.put((work, done))
        return done.result()

    def _finished(self) -> None:
        with self._lock:
            self._busy -= 1
            self._lock.notify_all()

    def close(self) -> None:
        """Let go of the pool's models once its run is over (a process that runs many federations must not
        keep every run's); work still to start is refused and training that runs stops at its next step
        (PoolClosed). The threads stay parked (ending a thread that ran torch made the process abort at
        exit in 4 of 10 runs of `fedmq simulate`); ``wait_idle`` waits until none of them is in torch."""
        with self._lock:
            self._open = False
            self._free = queue.Queue()
            self._decoded = {}
            self._lock.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no work runs on the pool's threads; False if some still did after ``timeout`` seconds.

        A daemon thread still inside torch when the interpreter exits aborts the process ("terminate called
        without an active exception", exit code 134: Python ends the thread as it takes the GIL back, in a C++
        frame that may not unwind), so a run waits for this after ``close`` before it returns."""
        with self._lock:
            return self._lock.wait_for(lambda: self._busy == 0, timeout)


@dataclass
class _Job:
    model: torch.nn.Module
    client: int
    cfg: TrainConfig
    progress: Progress | None
    done: Future = field(default_factory=Future)


class CohortPool(TrainerPool):
    """A pool whose borrowers train together (module docstring). Jobs wait until every agent the newest round
    selected has handed in its job or left the round (``taking_part``), every borrowed model's job is in, and
    nothing has happened for ``settle_s``; then they go to ``Task.train_cohort`` on one thread. A selected
    agent that never shows up (its announcement lost) is waited for ``patience_s`` of quiet at most, and not
    at all once every model of the pool is in a job. ``cohorts`` lists the sizes trained."""

    def __init__(
        self, task: Task, size: int = 1, seed: int = 0, settle_s: float = 0.2, patience_s: float = 10.0
    ) -> None:
        super().__init__(task, size, seed)
        self.settle_s, self.patience_s = settle_s, patience_s
        self.cohorts: list[int] = []
        self._cond = threading.Condition()
        self._borrowed = 0
        self._round = -1
        self._expected: set[str] = set()  # the newest round's selected agents with no job in and still in it
        self._jobs: list[_Job] = []
        self._last = time.monotonic()
        self._closed = False
        self._thread = threading.Thread(target=self._gather, name="cohort-trainer", daemon=True)
        self._thread.start()

    def _changed(self) -> None:
        """Under ``self._cond``: something happened, so the quiet period starts again and the gatherer
        looks."""
        self._last = time.monotonic()
        self._cond.notify_all()

    def _count(self, delta: int) -> None:
        with self._cond:
            self._borrowed += delta
            self._changed()

    @contextlib.contextmanager
    def borrow(self) -> Iterator[torch.nn.Module]:
        with super().borrow() as model:
            self._count(+1)
            try:
                yield model
            finally:
                self._count(-1)

    @contextlib.contextmanager
    def taking_part(self, round_number: int, selected: Sequence[str], agent: str) -> Iterator[None]:
        with self._cond:
            if round_number > self._round:  # the first of the round's agents to hear of it: expect them all
                self._round, self._expected = round_number, set(selected)
            self._changed()
        token = _PART.set(agent)
        try:
            yield
        finally:
            _PART.reset(token)
            with self._cond:
                self._expected.discard(agent)  # offline, crashed or failed: the cohort does not wait for it
                self._changed()

    def train(
        self, model: torch.nn.Module, client: int, cfg: TrainConfig, progress: Progress | None = None
    ) -> TrainResult:
        job = _Job(model, client, cfg, self._checked(progress))
        with self._cond:
            if self._closed:
                raise PoolClosed(CLOSED)
            self._jobs.append(job)
            self._expected.discard(_PART.get() or "")
            self._changed()
        return job.done.result()

    def close(self) -> None:
        """Let go of the models and park the gathering thread (TrainerPool.close); jobs waiting or handed in
        after (an agent still training when its run ended) fail."""
        super().close()
        with self._cond:
            self._closed = True
            for job in self._jobs:
                job.done.set_exception(PoolClosed(CLOSED))
            self._jobs = []
            self._cond.notify_all()

    def _next_cohort(self) -> list[_Job]:
        """The next cohort's jobs (never, once the pool is closed: the thread stays parked here)."""
        with self._cond:
            while True:
                if self._closed:
                    self._cond.wait()
                    continue
                ready = bool(self._jobs) and len(self._jobs) >= self._borrowed
                # with every model handed in, an agent still to come could not borrow one until this cohort
                # trains
                coming = self._expected if self._borrowed < self.size else ()
                wait = (self.patience_s if coming else self.settle_s) - (time.monotonic() - self._last)
                if ready and wait <= 0:
                    jobs, self._jobs = self._jobs, []
                    with self._lock:  # busy from here, so that wait_idle never misses a cohort starting
                        self._busy += 1
                    return jobs
                self._cond.wait(timeout=wait if ready else None)

    def _gather(self) -> None:
        while True:
            jobs = self._next_cohort()
            self.cohorts.append(len(jobs))
            try:
                results = self.task.train_cohort(
                    [j.model for j in jobs],
                    [j.client for j in jobs],
                    [j.cfg for j in jobs],
                    [j.progress for j in jobs],
                )
            except BaseException as exc:  # every job of the cohort fails with it, as each would have alone
                for j in jobs:
                    j.done.set_exception(exc)
                continue
            finally:
                self._finished()
            log.debug("cohort trained", clients=len(jobs), seconds=round(results[0].seconds, 2))
            for j, result in zip(jobs, results):
                j.done.set_result(result)


def _serve(jobs: queue.Queue[tuple[Callable[[], Any], Future]]) -> None:
    while True:
        work, done = jobs.get()
        try:
            done.set_result(work())
        except BaseException as exc:  # handed to the caller, which raises it
            done.set_exception(exc)
        del work, done  # parked, the thread holds nothing of its last job (its model)


class _TurnGate:
    """At most ``slots`` holders at once; a freed slot goes to the waiter with the smallest turn."""

    def __init__(self, slots: int) -> None:
        self._lock = threading.Lock()
        self._free = slots
        self._waiting: list[tuple[tuple[Any, ...], int, threading.Event]] = []  # a heap
        self._order = itertools.count()  # equal turns: first come, first in

    @contextlib.contextmanager
    def slot(self, turn: tuple[Any, ...]) -> Iterator[None]:
        with self._lock:
            if self._free:  # (then nobody waits: a freed slot goes to a waiter first)
                self._free -= 1
                given = None
            else:
                given = threading.Event()
                heapq.heappush(self._waiting, (turn, next(self._order), given))
        if given is not None:
            given.wait()  # the slot is handed over by whoever frees it
        try:
            yield
        finally:
            with self._lock:
                if self._waiting:
                    heapq.heappop(self._waiting)[2].set()
                else:
                    self._free += 1
