"""Rebuilding a cohort's secrets over worker processes (shamir.recover_all, aggregator.secret_pool):
the same secrets, the same shares named wrong and the same first refusal as recover() one secret at a time;
workers that ignore Ctrl-C, and a pool whose worker was killed gives way to the aggregator's own process."""

from __future__ import annotations

import os
import signal

import pytest

from fedmq.aggregator import secret_pool
from fedmq.errors import SecAggError
from fedmq.secagg import shamir


def _requests(count: int, wrong: set[int] = frozenset(), short: set[int] = frozenset()) -> tuple[list, list]:
    """``count`` secrets shared 3-of-6 among holders a..f: the request recover() takes for each (in
    ``wrong``, holder a's share is zeros; in ``short``, only two shares came)."""
    secrets, requests = [], []
    for i in range(count):
        secret = os.urandom(shamir.SECRET_BYTES)
        held = dict(zip("abcdef", shamir.split(secret, 3, 6)))
        if i in wrong:
            held["a"] = shamir.Share(held["a"].index, bytes(shamir.SECRET_BYTES))
        if i in short:
            held = {h: held[h] for h in "bc"}
        secrets.append(secret)
        requests.append((held, lambda candidate, s=secret: candidate == s, f"secret {i}"))
    return secrets, requests


@pytest.mark.parametrize("mapper", [map, secret_pool.spread], ids=["in-process", "worker-processes"])
def test_recover_all_gives_what_recover_gives_one_by_one(mapper):
    secrets, requests = _requests(12, wrong={4, 9})
    workers_cpu = secret_pool._worker_cpu
    got = shamir.recover_all(requests, 3, mapper)
    if mapper is secret_pool.spread and len(os.sched_getaffinity(0)) > 1:  # cpu_time counts the workers'
        assert secret_pool._worker_cpu > workers_cpu
    assert got == [shamir.recover(shares, 3, check, what) for shares, check, what in requests]
    assert [secret for secret, _ in got] == secrets
    assert [bad for _, bad in got] == [["a"] if i in {4, 9} else [] for i in range(12)]


@pytest.mark.parametrize("mapper", [map, secret_pool.spread], ids=["in-process", "worker-processes"])
def test_recover_all_refuses_the_first_secret_that_cannot_be_rebuilt(mapper):
    _, requests = _requests(6, short={2, 5})
    with pytest.raises(SecAggError, match=r"too-few-shares: secret 2 needs 3 shares, 2 came \(b, c\)"):
        shamir.recover_all(requests, 3, mapper)


def _ignores_sigint(pid: int) -> bool:
    status = open(f"/proc/{pid}/status").read()
    mask = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    return bool(mask & (1 << (signal.SIGINT - 1)))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: the pool combines in-process")
def test_workers_ignore_ctrl_c_and_a_broken_pool_gives_way_to_the_aggregators_process():
    secrets, requests = _requests(8)
    pool = secret_pool._get()
    secret_pool.warm()
    secret_pool.spread(shamir.combine_points, [[(1, bytes(16))]] * 8)  # every worker has started
    workers = list(pool._processes.values())  # this pool's workers, not other children of the process
    assert workers and all(_ignores_sigint(w.pid) for w in workers)  # Ctrl-C reaches the process group
    for worker in workers:
        os.kill(worker.pid, signal.SIGKILL)
    for worker in workers:
        worker.join()
    # the pool is broken: this round's secrets are rebuilt in-process, and the pool is dropped
    assert [s for s, _ in shamir.recover_all(requests, 3, secret_pool.spread)] == secrets
    assert secret_pool._pool is not pool
    assert [s for s, _ in shamir.recover_all(requests, 3, secret_pool.spread)] == secrets  # a new pool
    assert secret_pool._pool is not None and secret_pool._pool is not pool
