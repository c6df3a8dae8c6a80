"""The aggregator's worker processes for rebuilding secure aggregation's secrets over the machine's cores.

Unmasking a secure round rebuilds one secret per survivor (and one per dropped client) from its holders'
Shamir shares (fedmq.secagg.shamir.recover_all), and pycryptodome does that arithmetic in pure Python:
about 4.5 ms a secret at t = 11, all under the GIL, on the round's critical path while every client waits.
``combine`` shares those combinations out among one worker process per core.

A worker is ``python -m fedmq.aggregator.secret_pool``: it reads batches of shares on its stdin and writes
the combined secrets (and the CPU seconds they took) on its stdout, length-prefixed msgpack. It is a plain
subprocess, not multiprocessing's, so that it never imports the program that runs the aggregator (a user's
script without a ``__main__`` guard would run again in every worker). It holds nothing but the shares it is
sent (the secrets it gives back are the ones the aggregator rebuilds anyway), runs in a session of its own
(a Ctrl-C in the terminal stops the aggregator, not it), and exits when its stdin closes: with the
aggregator, however that ends. The workers start when a secure cohort forms (``warm``); a machine with one
core, or a worker that broke (killed, or unreadable), leaves the combining to the aggregator's own process.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

import msgpack
import structlog

from fedmq.secagg.shamir import Points, combine_points

log = structlog.get_logger(__name__)
_FRAME = struct.Struct(">I")
_lock = threading.Lock()
_workers: list[subprocess.Popen] | None = None
_worker_cpu = 0.0  # CPU seconds the workers spent on this process's batches


def cpu_time() -> float:
    """The aggregator's CPU seconds: its own process's and those its workers spent on its batches (a round's
    and the job's ``cpu_s`` are read off this clock)."""
    return time.process_time() + _worker_cpu


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _write(stream: IO[bytes], obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    stream.write(_FRAME.pack(len(data)) + data)
    stream.flush()


def _read(stream: IO[bytes]) -> Any:
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        raise EOFError("the stream ended")
    (size,) = _FRAME.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the stream ended inside a frame")
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


def _start() -> list[subprocess.Popen] | None:
    global _workers
    with _lock:
        if _workers is None and _cores() > 1:
            _workers = [
                subprocess.Popen(
                    [sys.executable, "-m", "fedmq.aggregator.secret_pool"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,  # a worker that fails is named by the aggregator's warning
                    start_new_session=True,
                )
                for _ in range(_cores())
            ]
        return _workers


def _drop(workers: list[subprocess.Popen]) -> None:
    global _workers
    with _lock:
        if _workers is workers:
            _workers = None
    for proc in workers:
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:  # what was left to flush into a dead worker's stdin
                    pass


def warm() -> None:
    """Start the workers now (an interpreter takes a tenth of a second or more to start), so that the round's
    unmasking does not wait for them: called when a secure cohort forms, while its clients train."""
    _start()


def combine(batch: list[Points]) -> list[bytes | None]:
    """``[combine_points(p) for p in batch]``, shared out among the workers where there are several."""
    global _worker_cpu
    workers = _start() if len(batch) > 1 else None
    if workers is None:
        return [combine_points(p) for p in batch]
    per = -(-len(batch) // len(workers))
    parts = [batch[i : i + per] for i in range(0, len(batch), per)]
    try:
        for proc, part in zip(workers, parts):
            _write(proc.stdin, [[list(point) for point in points] for points in part])  # type: ignore[arg-type]
        answers = [_read(proc.stdout) for proc, _ in zip(workers, parts)]  # type: ignore[arg-type]
        results = [r for secrets, _ in answers for r in secrets]
        if len(results) != len(batch):
            raise ValueError(f"{len(results)} secrets came back for {len(batch)}")
    except (OSError, EOFError, ValueError, TypeError, msgpack.UnpackException) as exc:
        log.warning("a secret worker broke: combining in the aggregator's process", error=str(exc))
        _drop(workers)
        return [combine_points(p) for p in batch]
    with _lock:
        _worker_cpu += sum(cpu for _, cpu in answers)
    return results


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """A worker's loop: a batch of share lists in, their secrets and the CPU seconds they took out."""
    while True:
        try:
            batch = _read(stdin)
        except EOFError:
            return
        start = time.process_time()
        secrets = [combine_points([(index, data) for index, data in points]) for points in batch]
        _write(stdout, [secrets, time.process_time() - start])


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
