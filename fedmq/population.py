"""How many simulated clients a `fedmq simulate` process can hold, from the host's own limits (torch-free).

Until clients are virtual, every simulated client is an agent with threads of its own: its loop, its presence
beat and, per broker connection, a dispatcher (the in-process broker: 3 threads a client; RabbitMQ: two
connections, presence on its own, each with an I/O thread and a dispatcher: 6). Each thread costs one task
slot (kernel.threads-max, RLIMIT_NPROC, the cgroup's pids.max), two memory maps (its stack and the stack's
guard page, against vm.max_map_count) and the part of its stack it touches. A run past any of those fails to
start threads half-way (MemoryError) and hangs; ``check_population`` refuses it at start instead, with the
limit and the fact it comes from. Memory per client is CLIENT_BYTES (the growth of a run's peak RSS from 100
to 1,000 clients of the language-model task, rounded up). Only HEADROOM of each limit is given to clients:
the aggregator, the trainers, torch and the broker need the rest.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from fedmq.errors import FedmqError

THREADS_PER_CLIENT = {"memory": 3, "amqp": 6}
MAPS_PER_THREAD = 2
CLIENT_BYTES = 2 << 20
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


def limits(backend: str = "memory") -> list[tuple[int, str]]:
    """(clients, the fact that bounds them) for every limit that can be read here, smallest first."""
    per_client = THREADS_PER_CLIENT["memory" if backend.startswith("memory") else "amqp"]
    found: list[tuple[int, str]] = []

    def add(free: int | None, cost: int, fact: str) -> None:
        if free is not None:
            found.append((max(int(free * HEADROOM) // cost, 0), fact))

    threads_max = _read_int("/proc/sys/kernel/threads-max")
    if threads_max is not None:
        add(threads_max - _threads_in_use(), per_client, f"kernel.threads-max {threads_max}")
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if nproc != resource.RLIM_INFINITY and os.geteuid() != 0:
        add(nproc - _threads_in_use(), per_client, f"RLIMIT_NPROC {nproc}")
    pids_max, pids_now = _cgroup("pids.max"), _cgroup("pids.current")
    if pids_max is not None:
        add(pids_max - (pids_now or 0), per_client, f"the cgroup's pids.max {pids_max}")
    maps = _read_int("/proc/sys/vm/max_map_count")
    if maps is not None:
        try:
            in_use = len(Path("/proc/self/maps").read_text().splitlines())
        except OSError:
            in_use = 0
        add(maps - in_use, per_client * MAPS_PER_THREAD, f"vm.max_map_count {maps}")
    mem = _mem_available()
    if mem is not None:
        add(mem, CLIENT_BYTES, f"{mem / 2**30:.1f} GiB of available memory")
    return sorted(found)


def check_population(clients: int, backend: str = "memory") -> None:
    """Refuse (PopulationTooLarge, one line) a population the host cannot start every client's threads for."""
    bound = limits(backend)
    if bound and clients > bound[0][0]:
        most, fact = bound[0]
        per = THREADS_PER_CLIENT["memory" if backend.startswith("memory") else "amqp"]
        raise PopulationTooLarge(
            f"clients (--clients) {clients} is more than a simulation can hold here: each simulated client "
            f"runs {per} threads, and {fact} leaves room for at most {most} clients; simulate at most {most}"
        )
