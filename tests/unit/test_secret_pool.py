"""Rebuilding a cohort's secrets on worker processes (shamir.recover_all, aggregator.secret_pool): the same
secrets, the same shares named wrong and the same first refusal as recover() one secret at a time; workers
in a session of their own (a Ctrl-C stops the aggregator, not them) that never run the aggregator's program,
and a killed worker that gives way to the aggregator's own process."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from load_factor import budget

from fedmq.aggregator import secret_pool
from fedmq.errors import SecAggError
from fedmq.secagg import shamir

BATCHES = [shamir.combine_each, secret_pool.combine]
IDS = ["in-process", "worker-processes"]
SEVERAL_CORES = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="one core: the aggregator combines in its own process"
)


def _requests(count: int, wrong: frozenset[int] = frozenset(), short: frozenset[int] = frozenset()):
    """``count`` secrets shared 3-of-6 among holders a..f, and the request recover() takes for each (in
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


@pytest.mark.parametrize("combine_batch", BATCHES, ids=IDS)
def test_recover_all_gives_what_recover_gives_one_by_one(combine_batch):
    secrets, requests = _requests(12, wrong=frozenset({4, 9}))
    workers_cpu = secret_pool._worker_cpu
    got = shamir.recover_all(requests, 3, combine_batch)
    assert got == [shamir.recover(shares, 3, check, what) for shares, check, what in requests]
    assert [secret for secret, _ in got] == secrets
    assert [bad for _, bad in got] == [["a"] if i in {4, 9} else [] for i in range(12)]
    if combine_batch is secret_pool.combine and len(os.sched_getaffinity(0)) > 1:  # cpu_time counts them
        assert secret_pool._worker_cpu > workers_cpu


@pytest.mark.parametrize("combine_batch", BATCHES, ids=IDS)
def test_recover_all_refuses_the_first_secret_that_cannot_be_rebuilt(combine_batch):
    _, requests = _requests(6, short=frozenset({2, 5}))
    with pytest.raises(SecAggError, match=r"too-few-shares: secret 2 needs 3 shares, 2 came \(b, c\)"):
        shamir.recover_all(requests, 3, combine_batch)


@SEVERAL_CORES
def test_workers_live_apart_and_a_killed_one_gives_way_to_the_aggregators_process():
    secrets, requests = _requests(8)
    secret_pool.warm()
    workers = secret_pool._workers
    assert workers and all(os.getsid(w.pid) not in (os.getsid(0), os.getpgid(0)) for w in workers)
    assert [s for s, _ in shamir.recover_all(requests, 3, secret_pool.combine)] == secrets
    os.kill(workers[-1].pid, signal.SIGKILL)
    workers[-1].wait()
    # a worker is gone: this round's secrets are rebuilt in-process, and the workers are replaced
    assert [s for s, _ in shamir.recover_all(requests, 3, secret_pool.combine)] == secrets
    assert secret_pool._workers is None and all(w.poll() is not None for w in workers)
    assert [s for s, _ in shamir.recover_all(requests, 3, secret_pool.combine)] == secrets
    assert secret_pool._workers is not None and secret_pool._workers is not workers


@SEVERAL_CORES
def test_a_script_without_a_main_guard_does_not_run_again_in_the_workers(tmp_path: Path):
    """multiprocessing's workers would import the program's main module; these are started apart."""
    marker = tmp_path / "runs"
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os
            from fedmq.aggregator import secret_pool
            from fedmq.secagg import shamir
            with open({str(marker)!r}, "a") as f:
                f.write("run\\n")
            shares = shamir.split(os.urandom(16), 2, 3)
            points = [(s.index, s.data) for s in shares[:2]]
            assert secret_pool.combine([points, points]) == [shamir.combine_points(points)] * 2
            assert secret_pool._workers is not None
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert marker.read_text() == "run\n"


@SEVERAL_CORES
def test_the_workers_end_with_the_aggregator_however_it_ends(tmp_path: Path):
    """A kill -9 of the aggregator closes the workers' stdin: they exit (pidfd: the exit is the event)."""
    script = tmp_path / "aggregator.py"
    script.write_text(
        "import sys\nfrom fedmq.aggregator import secret_pool\nsecret_pool.warm()\n"
        "print(*(w.pid for w in secret_pool._workers), flush=True)\nsys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert pids
    pidfds = [os.pidfd_open(pid) for pid in pids]
    proc.kill()
    proc.wait()
    poller = select.poll()
    for fd in pidfds:
        poller.register(fd, select.POLLIN)
    ended: set[int] = set()
    while len(ended) < len(pidfds):
        events = poller.poll(budget(120) * 1000)
        assert events, f"workers {pids} still run after their aggregator was killed"
        for fd, _ in events:
            ended.add(fd)
            poller.unregister(fd)
    for fd in pidfds:
        os.close(fd)
