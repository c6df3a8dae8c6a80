"""Optional allocator tuning for processes that move large models (aggregator, agents, benchmarks).

Every encode/decode allocates buffers the size of the model. glibc serves allocations over its mmap
threshold with fresh mmaps and unmaps them on free, so each message pays page faults on every byte; on
this project's VMs that costs more than the codec itself (fresh-memory copies measured at 0.1-0.7 GB/s
against 3-6 GB/s for reused memory). ``tune_allocator()`` makes glibc keep freed memory for reuse
(M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB). Trade-off: the process keeps its peak heap instead of returning
it to the OS. Call it once at service start; a no-op returning False off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import structlog

log = structlog.get_logger(__name__)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_done: bool | None = None


def tune_allocator() -> bool:
    """Keep freed large buffers in the heap for reuse; True if glibc accepted the settings."""
    global _done
    if _done is not None:
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        ok = False
    _done = ok
    log.debug("allocator tuned" if ok else "allocator tuning unavailable")
    return ok
