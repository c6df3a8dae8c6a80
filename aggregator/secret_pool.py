"""The aggregator's worker processes for rebuilding secure aggregation's secrets over the machine's cores.

Unmasking a secure round rebuilds one secret per survivor (and one per dropped client) from its holders'
Shamir shares (fedmq.secagg.shamir.recover_all), and pycryptodome does that arithmetic in pure Python:
about 4.5 ms a secret at t = 11, all under the GIL, on the round's critical path while every client waits.
``spread`` runs those combinations over one worker process per core. The workers hold nothing but the
shares they are sent (the secrets they give back are the ones the aggregator rebuilds anyway); they start
on the first secure cohort (``warm``), ignore Ctrl-C (the aggregator stops and ends them), and exit with
the aggregator.
A machine with one core, or a pool that broke (a worker killed), combines in the aggregator's own process.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import structlog

from fedmq.secagg.shamir import Points

log = structlog.get_logger(__name__)
_lock = threading.Lock()
_pool: ProcessPoolExecutor | None = None
_worker_cpu = 0.0  # CPU seconds the workers spent on this process's tasks


def cpu_time() -> float:
    """The aggregator's CPU seconds: its own process's and those its workers spent on its tasks (a round's
    and the job's ``cpu_s`` are read off this clock)."""
    return time.process_time() + _worker_cpu


def _quiet() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _timed(fn: Callable[[Points], bytes | None], x: Points) -> tuple[bytes | None, float]:
    start = time.process_time()
    return fn(x), time.process_time() - start


def _nothing() -> None:
    """A task that makes the pool start a worker."""


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _get() -> ProcessPoolExecutor | None:
    global _pool
    with _lock:
        if _pool is None and _cores() > 1:
            _pool = ProcessPoolExecutor(
                max_workers=_cores(), mp_context=multiprocessing.get_context("spawn"), initializer=_quiet
            )
        return _pool


def _drop(pool: ProcessPoolExecutor) -> None:
    global _pool
    with _lock:
        if _pool is pool:
            _pool = None
    pool.shutdown(wait=False, cancel_futures=True)


def warm() -> None:
    """Start the workers now (a spawned interpreter takes a few tenths of a second), so that the round's
    unmasking does not wait for them: called when a secure cohort forms, while its clients train."""
    pool = _get()
    if pool is not None:
        for _ in range(_cores()):
            pool.submit(_nothing)


def spread(fn: Callable[[Points], bytes | None], items: list[Points]) -> list[bytes | None]:
    """``[fn(x) for x in items]``, over the workers where there are several items and cores."""
    global _worker_cpu
    pool = _get() if len(items) > 1 else None
    if pool is None:
        return [fn(x) for x in items]
    chunk = max(1, len(items) // (4 * _cores()))
    try:
        done = list(pool.map(functools.partial(_timed, fn), items, chunksize=chunk))
    except BrokenProcessPool as exc:
        log.warning("secret pool broke: rebuilding in the aggregator's process", error=str(exc))
        _drop(pool)
        return [fn(x) for x in items]
    with _lock:
        _worker_cpu += sum(cpu for _, cpu in done)
    return [result for result, _ in done]
