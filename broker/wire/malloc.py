"""Optional allocator tuning for processes that move large models (aggregator, agents, benchmarks).

Every encode/decode allocates buffers the size of the model. glibc serves allocations over its mmap
threshold with fresh mmaps and unmaps them on free, so each message pays page faults on every byte; on
this project's VMs that costs more than the codec itself (fresh-memory copies measured at 0.1-0.7 GB/s
against 3-6 GB/s for reused memory). ``tune_allocator()`` makes glibc keep freed memory for reuse
(M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB). Trade-off: the process keeps its peak heap instead of returning
it to the OS. So that "its peak heap" is one heap, not one per thread, it also makes glibc use one arena
(M_ARENA_MAX = 1): a simulation runs an agent thread per client, and with glibc's default of 8 arenas per core
each encoding thread kept its own model-sized buffers (`fedmq simulate` at K = 100 of a 42 MB model: peak RSS
3.92 GB, 2.93 GB with 2 arenas, less again with 1 and no slower, measured 2026-11-22 on a 2-core VM).
Call it once at service start; a no-op returning False off glibc.

The tuned heap never shrinks by itself, and it fragments: a freed model-sized buffer is split by the small
allocations that follow, so the next one takes fresh memory. A process that decodes and folds update after
update (and, in a simulation, trains and encodes them) then grows by about 1.3 MB an update while the memory
it uses stays flat (GRU-small, m = 300 of K = 10,000: 0.5 GB in use, 1.4 GB free in the heap after two
rounds; glibc's mallinfo2). ``release_free()`` gives the free pages back (malloc_trim: tens of ms); a
``Trimmer`` calls it every few model-sized buffers freed: the aggregator every 16 updates it parks or folds
(aggregator.engine.RELEASE_EVERY) once its resident memory grew by more than 256 MiB since the last return
(RELEASE_GROWTH), so that a round's memory does not grow with its cohort m, and a host of secure clients
every 4 buffers its clients free (client_agent.secure_upload.TRIM_EVERY).

In a busy simulation the growth is passed at nearly every check: faulting the working set (the buffers freed
and taken again with every update) back in after a return alone grows the process by more than 256 MiB
(GRU-small, m = 1,000 of K = 10,000, two trainers: 209 returns in two rounds). Measuring the growth from the
first check after a return instead, with the working set back, returned 25 times and ran a round in 66.9
against 74.0 s (one run each, back to back), but its peak at m = 1,000 was 1.94-2.00 GB in three bench runs
(two with 256 MiB, one with 128 MiB), against the 2 GB goal of docs/benchmarks.md, whose runs with this rule
give the figures it keeps: not kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

import structlog

log = structlog.get_logger(__name__)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_done: bool | None = None
_libc: ctypes.CDLL | None = None  # glibc, once tune_allocator has tuned it


def tune_allocator() -> bool:
    """Keep freed large buffers in the heap for reuse; True if glibc accepted the settings."""
    global _done, _libc
    if _done is not None:
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = (
            bool(libc.mallopt(_M_MMAP_MAX, 0))
            and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
            and bool(libc.mallopt(_M_ARENA_MAX, 1))
        )
    except (OSError, AttributeError):
        ok = False
    _done, _libc = ok, (libc if ok else None)
    log.debug("allocator tuned" if ok else "allocator tuning unavailable")
    return ok


def release_free() -> bool:
    """Give the tuned heap's free pages back to the OS; False (and nothing done) where it was not tuned."""
    return _libc is not None and bool(_libc.malloc_trim(0))


def resident() -> int | None:
    """This process's resident memory in bytes (/proc/self/statm), or None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class Trimmer:
    """``release_free()`` at every ``every``-th ``took()``, counted across the process's threads. Returning
    the free pages bounds the heap, but each return costs the page faults of touching them again: a host
    that gave its pages back after every client of a secure round spent about a fifth of its CPU refilling
    them (its training's buffers included), against none in a plain round."""

    def __init__(self, every: int, growth: int = 0) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, not {every}")
        self.every, self.growth = every, growth
        self._count = 0
        self._floor: int | None = None  # resident bytes after the last return (or at the first check)
        self._lock = threading.Lock()

    def took(self) -> bool:
        """One more model-sized buffer freed; True when this call gave the free pages back: at every
        ``every``-th call, once the process's resident memory has grown by more than ``growth`` bytes since
        the last return (0: at every ``every``-th call). Pages the process reuses are then left where they
        are, rather than given back and faulted in again by the next buffers."""
        with self._lock:
            self._count += 1
            due = self._count % self.every == 0
            if not due:
                return False
            if self.growth > 0:
                now = resident()
                if now is not None:
                    self._floor = now if self._floor is None else self._floor
                    if now - self._floor <= self.growth:
                        return False
            if not release_free():
                return False
            if self.growth > 0:  # the floor the next growth is measured from
                self._floor = resident()
            return True
