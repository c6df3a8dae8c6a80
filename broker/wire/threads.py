"""Worker threads of the wire codec.

zstd (python-zstandard) and numpy's copies, casts and reductions release the GIL, so the byte planes of a
model's tensors compress, decompress and (un)shuffle in parallel on a small shared thread pool. A task is a
``(cost, fn)`` pair; ``run_all`` runs a batch, largest cost first, and returns the results in the given
order. Batches whose total cost (bytes) is small run inline: a thread hand-off costs more than it saves.

Choices: the pool has one thread per usable core, at most 4 (``set_codec_threads`` changes it; 1 = no
threads); it is created on first use and re-created after ``fork`` (a forked child has no pool threads).
A task that runs ``run_all`` itself runs that batch inline (no nested waits on the same pool).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

INLINE_BELOW = 1 << 20  # total task cost (bytes) under which a batch runs in the calling thread
_MAX_DEFAULT = 4
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_threads: int | None = None
_local = threading.local()

Task = tuple[int, Callable[[], Any]]


def _default_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(_MAX_DEFAULT, cores))


def codec_threads() -> int:
    """Threads the codec uses (1 = everything runs in the calling thread)."""
    return _threads if _threads is not None else _default_threads()


def set_codec_threads(n: int) -> None:
    """Use ``n`` codec threads from now on (1 disables the pool); ValueError unless 1 <= n <= 64."""
    global _threads, _pool
    if type(n) is not int or not 1 <= n <= 64:
        raise ValueError(f"codec threads must be an int in 1..64, got {n!r}")
    with _lock:
        old, _pool, _threads = _pool, None, n
    if old is not None:
        old.shutdown(wait=True)


def _mark_worker() -> None:
    _local.worker = True


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                codec_threads(), thread_name_prefix="fedmq-codec", initializer=_mark_worker
            )
        return _pool


def _forget_pool_after_fork() -> None:
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def run_all(tasks: Sequence[Task], ordered: bool = False) -> list[Any]:
    """Run every task; results in task order. Waits for all before raising the first error in task order.

    The pool starts tasks largest cost first, or in the given order if ``ordered`` (tasks may then wait
    for earlier ones of the batch, which have all started when they run).
    """
    if not tasks:
        return []
    if (
        len(tasks) == 1
        or codec_threads() == 1
        or getattr(_local, "worker", False)
        or sum(c for c, _ in tasks) < INLINE_BELOW
    ):
        return [fn() for _, fn in tasks]
    pool = _get_pool()
    order = range(len(tasks)) if ordered else sorted(range(len(tasks)), key=lambda i: -tasks[i][0])
    futures: list[Any] = [None] * len(tasks)
    for i in order:
        futures[i] = pool.submit(tasks[i][1])
    wait(futures)
    return [f.result() for f in futures]
