"""The aggregator's worker processes for rebuilding secure aggregation's secrets over the machine's cores.

Unmasking a secure round rebuilds one secret per survivor (and one per dropped client) from its holders'
Shamir shares (fedmq.secagg.shamir.recover_all), and pycryptodome does that arithmetic in pure Python:
about 4.5 ms a secret at t = 11, all under the GIL, on the round's critical path while every client waits.
``combine`` shares those combinations out among worker processes, one per core the aggregator may use (its
CPU affinity and its cgroup's CPU quota, at most MAX_WORKERS).

A worker is a plain subprocess, ``python -P -m fedmq.aggregator.secret_worker``, not one of
multiprocessing's, so that it never imports the program that runs the aggregator (a user's script without
a ``__main__`` guard would run again in every worker) nor anything from the directory it was started in. It
holds nothing but the shares it is sent (the secrets it gives back are the ones the aggregator rebuilds
anyway), runs in a session of its own (a Ctrl-C in the terminal stops the aggregator, not it), and exits
when its stdin closes: with the aggregator, however that ends. The workers start when a secure cohort forms
(``warm``). Where they cannot start, or one breaks (killed, unreadable, or silent for TIMEOUT_S), the
aggregator kills them, says so once, and combines in its own process from then on. The CPU seconds the
workers report (start-up included, up to each one's last answer) count in the aggregator's ``cpu_time``.
"""

from __future__ import annotations

import math
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from fedmq.aggregator.secret_worker import read_frame, write_frame
from fedmq.secagg.shamir import Points, combine_each

log = structlog.get_logger(__name__)
MAX_WORKERS = 8
TIMEOUT_S = (
    60.0  # a worker that has not taken or answered its batch in this long (or 10 ms a secret) is stuck
)
_CGROUP = Path("/sys/fs/cgroup")
_lock = threading.Lock()  # the state below
_exchange = threading.Lock()  # one batch at a time goes through the workers' pipes
_workers: list[subprocess.Popen] | None = None
_off: str | None = None  # why the workers are not used (None: they are, or will be)
_reported: dict[int, float] = {}  # a worker's pid -> the CPU seconds it last reported
_worker_cpu = 0.0  # CPU seconds the workers spent, as they reported them


def cpu_time() -> float:
    """The aggregator's CPU seconds: its own process's and its workers' (a round's and the job's ``cpu_s``
    are read off this clock)."""
    return time.process_time() + _worker_cpu


def _quota() -> float | None:
    """The cores this process's cgroup may use (cgroup v2 cpu.max or v1's CFS quota); None when unlimited."""
    try:
        quota, period = (_CGROUP / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((_CGROUP / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((_CGROUP / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def cores() -> int:
    """The workers to start: the cores this process may run on, its CPU quota rounded up, MAX_WORKERS."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _quota()
    return min(n, MAX_WORKERS, math.ceil(quota) if quota else n)


def _kill(workers: list[subprocess.Popen]) -> None:
    for proc in workers:
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:  # what was left to flush into a dead worker's stdin
                    pass


def _turn_off(why: str) -> None:
    """No workers from now on (called with _lock held)."""
    global _workers, _off
    if _workers is not None:
        _kill(_workers)
    _workers, _off = None, why
    log.warning("secret workers off: combining in the aggregator's process", reason=why)


def _start() -> list[subprocess.Popen] | None:
    global _workers, _off
    with _lock:
        if _workers is not None or _off is not None:
            return _workers
        if cores() < 2:
            _off = "one core"  # nothing to spread over: not a fault, nothing logged
            return None
        if not sys.executable:
            _turn_off("no Python executable to start them with")
            return None
        started: list[subprocess.Popen] = []
        try:
            for _ in range(cores()):
                started.append(
                    subprocess.Popen(
                        [sys.executable, "-P", "-m", "fedmq.aggregator.secret_worker"],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        except OSError as exc:
            _kill(started)
            _turn_off(f"they cannot start: {exc}")
            return None
        for proc in started:
            assert proc.stdin is not None and proc.stdout is not None
            os.set_blocking(proc.stdin.fileno(), False)
        _workers = started
        return _workers


def warm() -> None:
    """Start the workers now (an interpreter takes a tenth of a second or more to start), so that the round's
    unmasking does not wait for them: called when a secure cohort forms, while its clients train."""
    _start()


def _ready(fd: int, events: int, deadline: float) -> Callable[[], None]:
    """A ``wait`` for secret_worker's frames: until ``fd`` is ready for ``events``, or TimeoutError."""

    def wait() -> None:
        poller = select.poll()
        poller.register(fd, events)
        if not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            raise TimeoutError(f"a worker was silent for {TIMEOUT_S:.0f} s or more")

    return wait


def combine(batch: list[Points]) -> list[bytes | None]:
    """``combine_each(batch)``, shared out among the workers where there are several items and workers."""
    global _worker_cpu
    if len(batch) < 2:
        return combine_each(batch)
    with _exchange:
        workers = _start()
        if workers is None:
            return combine_each(batch)
        per = -(-len(batch) // len(workers))
        parts = [batch[i : i + per] for i in range(0, len(batch), per)]
        deadline = time.monotonic() + max(TIMEOUT_S, 0.01 * len(batch))
        busy = workers[: len(parts)]
        try:
            for proc, part in zip(busy, parts):
                fd = proc.stdin.fileno()  # type: ignore[union-attr]
                write_frame(
                    fd, [[list(p) for p in points] for points in part], _ready(fd, select.POLLOUT, deadline)
                )
            answers = []
            for proc in busy:
                fd = proc.stdout.fileno()  # type: ignore[union-attr]
                answers.append(read_frame(fd, _ready(fd, select.POLLIN, deadline)))
            results = [secret for secrets, _ in answers for secret in secrets]
            if len(results) != len(batch):
                raise ValueError(f"{len(results)} secrets came back for {len(batch)}")
        except BaseException as exc:  # the pipes may hold half a frame: these workers are done
            with _lock:
                _turn_off(f"a worker broke: {type(exc).__name__}: {exc}")
            if not isinstance(exc, Exception):
                raise
            return combine_each(batch)
        with _lock:
            for proc, (_, cpu) in zip(busy, answers):
                _worker_cpu += cpu - _reported.get(proc.pid, 0.0)
                _reported[proc.pid] = cpu
        return results
