"""How much slower than an idle machine this one runs now: the factor a test's duration budget is scaled by.

A test asserts events and orderings, not seconds. Where a duration is the point (a second signal ends a
process at once; a refused connection fails fast) or a wait must end some time (a process start, a
rabbitmqctl call, pytest-timeout's per-test limit), the seconds are ``budget(s)``: ``s`` on an idle machine,
``s * factor()`` on a busy one, so that a suite run beside other work (load 10-40 on two cores) does not
fail healthy tests while a hung one still ends.

``factor()`` is the larger of two measures, clamped to [1, 20]:

* a calibration, once per process (a pytest worker: at its first call): a fixed pure-Python loop (``LOOP``
  additions, about ``REFERENCE_S`` of CPU on a current x86 server core under CPython 3.11) timed by the
  wall clock against that reference figure. It sees both a slower CPU and the share of a core this process
  gets now.
* the 1-minute load average per CPU this process may run on, read at each call: a load that arrives after
  the calibration (the suite's own workers start their subprocesses) counts too.

$FEDMQ_TEST_LOAD_FACTOR, when set, is the factor (e.g. 1 to see a test's bare budget).
"""

from __future__ import annotations

import functools
import os
import time

LOOP = 500_000
REFERENCE_S = 0.1
MIN_FACTOR, MAX_FACTOR = 1.0, 20.0


@functools.cache
def calibration() -> float:
    """The calibration loop's wall time over REFERENCE_S (measured once per process)."""
    t0, n = time.perf_counter(), 0
    for i in range(LOOP):
        n += i
    return (time.perf_counter() - t0) / REFERENCE_S


def load_per_cpu() -> float:
    """The 1-minute load average over the CPUs this process may run on (0 where the OS has none)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        return os.getloadavg()[0] / cpus
    except OSError:
        return 0.0


def factor() -> float:
    """How many times an idle machine's seconds a duration takes here now, in [1, 20]."""
    forced = os.environ.get("FEDMQ_TEST_LOAD_FACTOR")
    measured = float(forced) if forced else max(calibration(), load_per_cpu())
    return min(max(measured, MIN_FACTOR), MAX_FACTOR)


def budget(seconds: float) -> float:
    """``seconds`` (what an idle machine needs, with a margin) scaled to this machine's load now."""
    return seconds * factor()
