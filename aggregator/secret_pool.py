"""The aggregator's worker processes for rebuilding secure aggregation's secrets over the machine's cores.

Unmasking a secure round rebuilds one secret per survivor (and one per dropped client) from its holders'
Shamir shares (fedmq.secagg.shamir.recover_all): a Python loop over FLINT's field operations, about 0.3 ms a
secret at t = 11, all under the GIL, on the round's critical path while every client waits (0.4 s at 1,000
survivors in one process, 0.18 s on two workers).
``combine`` shares those combinations out among worker processes, one per core the aggregator may use (its
CPU affinity and the CPU quota of its cgroup and the cgroups above it, at most MAX_WORKERS).

A worker is a plain subprocess, ``python -P -m fedmq.aggregator.secret_worker``, not one of
multiprocessing's, so that it never imports the program that runs the aggregator (a user's script without
a ``__main__`` guard would run again in every worker) nor anything from the directory it was started in. It
holds nothing but the shares it is sent (the secrets it gives back are the ones the aggregator rebuilds
anyway), is detached from the terminal (a Ctrl-C there stops the aggregator, not it), and exits
when its stdin closes: with the aggregator, however that ends. The workers start when a secure cohort forms
(``warm``). Where one breaks (killed, unreadable, or a batch not done within its deadline: TIMEOUT_S, or 10
ms a secret if longer), the aggregator kills them all, combines that batch in its own process and starts new
workers for the next; where they cannot start, or have broken MAX_BREAKS times, it says so and combines in
its own process from then on. The workers' CPU seconds (start-up included: what each reported with its last
answer, or what it had used when it was killed) count in the aggregator's ``cpu_time``.
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
MAX_BREAKS = 3  # workers broken this often in one process are not started again
TIMEOUT_S = 60.0  # a batch's deadline (or 10 ms a secret, if longer): a worker not done by then is stuck
_CGROUP = Path("/sys/fs/cgroup")
_lock = threading.Lock()  # the state below
_exchange = threading.Lock()  # one batch at a time goes through the workers' pipes
_workers: list[subprocess.Popen] | None = None
_off: str | None = None  # why the workers are not used (None: they are, or will be)
_breaks = 0  # batches the workers failed
_reported: dict[subprocess.Popen, float] = {}  # a worker -> the CPU seconds it last reported
_worker_cpu = 0.0  # CPU seconds the workers spent, as they reported them or as they were reaped


def cpu_time() -> float:
    """The aggregator's CPU seconds: its own process's and its workers' (a round's and the job's ``cpu_s``
    are read off this clock)."""
    return time.process_time() + _worker_cpu


def _read_quota(path: Path, v2: bool) -> float | None:
    try:
        if v2:
            quota, period = path.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int(path.read_text())
        period_us = int((path.parent / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _quota() -> float | None:
    """The cores this process may use by CPU quotas (cgroup v2's ``cpu.max`` of its cgroup and of those above
    it, or v1's CFS quota); None when none is set."""
    folders = [_CGROUP]
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        if line.startswith("0::"):  # cgroup v2, the unified hierarchy: this process's cgroup, then up
            own = _CGROUP / line[3:].strip().lstrip("/")
            folders += [own, *(p for p in own.parents if p.is_relative_to(_CGROUP))]
    found = [q for f in folders if (q := _read_quota(f / "cpu.max", v2=True)) is not None]
    v1 = _read_quota(_CGROUP / "cpu" / "cpu.cfs_quota_us", v2=False)
    found += [v1] if v1 is not None else []
    return min(found) if found else None


def cores() -> int:
    """The workers to start: the cores this process may run on, its CPU quota rounded up, MAX_WORKERS."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _quota()
    return min(n, MAX_WORKERS, math.ceil(quota) if quota else n)


def _kill(workers: list[subprocess.Popen]) -> None:
    """Kill and reap ``workers``, counting the CPU each used after its last answer (with _lock held)."""
    global _worker_cpu
    for proc in workers:
        proc.kill()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            _worker_cpu += max(0.0, usage.ru_utime + usage.ru_stime - _reported.get(proc, 0.0))
        except ChildProcessError:  # reaped already
            proc.wait()
        _reported.pop(proc, None)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:  # what was left to flush into a dead worker's stdin
                    pass


def _turn_off(why: str) -> None:
    """No workers from now on (with _lock held)."""
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
        count = cores()
        if count < 2:
            _off = "one core"  # nothing to spread over: not a fault, nothing logged
            return None
        if not sys.executable:
            _turn_off("no Python executable to start them with")
            return None
        started: list[subprocess.Popen] = []
        try:
            for _ in range(count):
                proc = subprocess.Popen(
                    [sys.executable, "-P", "-m", "fedmq.aggregator.secret_worker"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
                started.append(proc)
                os.set_blocking(proc.stdin.fileno(), False)  # type: ignore[union-attr]
        except BaseException as exc:  # none of them is kept
            _kill(started)
            _turn_off(f"they cannot start: {type(exc).__name__}: {exc}")
            if not isinstance(exc, Exception):
                raise
            return None
        _workers = started
        return _workers


def _broke(why: str) -> None:
    """The workers failed a batch: killed, to be started afresh for the next, or turned off for good."""
    global _workers, _breaks
    with _lock:
        _breaks += 1
        if _breaks >= MAX_BREAKS:
            _turn_off(f"they broke {_breaks} times, last: {why}")
            return
        if _workers is not None:
            _kill(_workers)
        _workers = None
    log.warning("a secret worker broke: this batch combined in the aggregator's process", reason=why)


def warm() -> None:
    """Start the workers now (an interpreter takes a tenth of a second or more to start), so that the round's
    unmasking does not wait for them: called when a secure cohort forms, while its clients train."""
    _start()


def _ready(fd: int, events: int, deadline: float, allowed: float) -> Callable[[], None]:
    """A ``wait`` for secret_worker's frames: until ``fd`` is ready for ``events``, or TimeoutError once
    ``deadline`` (``allowed`` seconds after the batch began) has passed."""

    def wait() -> None:
        poller = select.poll()
        poller.register(fd, events)
        if not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            raise TimeoutError(f"a batch of secrets was not done within {allowed:.3g} s")

    return wait


def _checked(answer: object, count: int) -> tuple[list[bytes | None], float]:
    """A worker's answer to a part of ``count`` items, or ValueError (a worker of another build, broken)."""
    if (
        not isinstance(answer, list)
        or len(answer) != 2
        or not isinstance(answer[0], list)
        or len(answer[0]) != count
        or not all(x is None or isinstance(x, bytes) for x in answer[0])
        or not isinstance(answer[1], (int, float))
    ):
        raise ValueError(f"a worker's answer is not {count} secrets and its CPU seconds")
    return answer[0], float(answer[1])


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
        busy = workers[: len(parts)]
        allowed = max(TIMEOUT_S, 0.01 * len(batch))
        deadline = time.monotonic() + allowed
        try:
            for proc, part in zip(busy, parts):
                fd = proc.stdin.fileno()  # type: ignore[union-attr]
                frame = [[list(p) for p in points] for points in part]
                write_frame(fd, frame, _ready(fd, select.POLLOUT, deadline, allowed))
            answers = []
            for proc, part in zip(busy, parts):
                fd = proc.stdout.fileno()  # type: ignore[union-attr]
                answer = read_frame(fd, _ready(fd, select.POLLIN, deadline, allowed))
                answers.append(_checked(answer, len(part)))
        except BaseException as exc:  # the pipes may hold half a frame: these workers are done
            _broke(f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, Exception):
                raise
            return combine_each(batch)
        with _lock:
            for proc, (_, cpu) in zip(busy, answers):
                _worker_cpu += max(0.0, cpu - _reported.get(proc, 0.0))
                _reported[proc] = cpu
        return [secret for secrets, _ in answers for secret in secrets]
