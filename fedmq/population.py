"""How many simulated clients a `fedmq simulate` process can hold, from the host's own limits (torch-free).

Simulated clients are virtual (client_agent.host): one that is not selected has no thread and costs
CLIENT_BYTES (the aggregator's presence entry and its host's, the run's per-round client lists: the growth of
a run's peak RSS from K = 1,000 to 100,000, rounded up). A client in a round runs in a thread of its own:
the m selected of a synchronous round, and in asynchronous mode at most client_agent.host.ASYNC_AT_ONCE at
once (the others take turns).
Each thread costs one task slot (kernel.threads-max, RLIMIT_NPROC, the cgroup's pids.max), two memory maps
(its stack and the stack's guard page, against vm.max_map_count) and the part of its stack it touches. A
run past any of those would fail to start threads half-way (MemoryError); ``check_population`` refuses it at
start instead, with the limit and the fact it comes from. Only HEADROOM of each limit is given to clients:
the aggregator, the trainers, torch and the broker need the rest.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from fedmq.errors import FedmqError

MAPS_PER_THREAD = 2
CLIENT_BYTES = 2 << 10
HEADROOM = 0.8


class PopulationTooLarge(FedmqError):
    """More simulated clients than the process can start threads and memory for: one line, exit code 2."""

    exit_code = 2


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().split()[0]
    except (OSError, IndexError):
        return None
    return int(text) if text.isdigit() else None


def _cgroup(name: str) -> int | None:
    return _read_int(f"/sys/fs/cgroup/{name}")


def _threads_in_use() -> int:
    """Tasks on the host now (/proc/loadavg's running/total)."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    except (OSError, IndexError, ValueError):
        return 0


def _mem_available() -> int | None:
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        free = None
    limit, used = _cgroup("memory.max"), _cgroup("memory.current")
    if limit is not None and used is not None:
        free = min(free, limit - used) if free is not None else limit - used
    return free


def limits(in_round: float = 1.0) -> list[tuple[int, str]]:
    """(clients, the fact that bounds them) for every limit that can be read here, smallest first, when a
    share ``in_round`` of the clients is in a round at once, a thread each (m/K in a synchronous round)."""
    found: list[tuple[int, str]] = []

    def add(free: int | None, cost: float, fact: str) -> None:
        if free is not None and cost > 0:
            found.append((max(int(free * HEADROOM / cost), 0), fact))

    threads_max = _read_int("/proc/sys/kernel/threads-max")
    if threads_max is not None:
        add(threads_max - _threads_in_use(), in_round, f"kernel.threads-max {threads_max}")
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if nproc != resource.RLIM_INFINITY and os.geteuid() != 0:
        add(nproc - _threads_in_use(), in_round, f"RLIMIT_NPROC {nproc}")
    pids_max, pids_now = _cgroup("pids.max"), _cgroup("pids.current")
    if pids_max is not None:
        add(pids_max - (pids_now or 0), in_round, f"the cgroup's pids.max {pids_max}")
    maps = _read_int("/proc/sys/vm/max_map_count")
    if maps is not None:
        try:
            in_use = len(Path("/proc/self/maps").read_text().splitlines())
        except OSError:
            in_use = 0
        add(maps - in_use, in_round * MAPS_PER_THREAD, f"vm.max_map_count {maps}")
    mem = _mem_available()
    if mem is not None:
        add(mem, CLIENT_BYTES, f"{mem / 2**30:.1f} GiB of available memory")
    return sorted(found)


def check_population(clients: int, in_round: int | None = None) -> None:
    """Refuse (PopulationTooLarge, one line) a population the host cannot hold when ``in_round`` of its
    clients (default: all of them) are in a round at once."""
    at_once = clients if in_round is None else min(in_round, clients)
    bound = limits(at_once / max(clients, 1))
    if bound and clients > bound[0][0]:
        most, fact = bound[0]
        why = f"{fact}, with {at_once} of them in a round at once (a thread each)," if at_once else fact
        raise PopulationTooLarge(
            f"clients (--clients) {clients} is more than a simulation can hold here: {why} leaves room "
            f"for at most {most} clients; simulate at most {most}"
        )
