"""Rebuilding a cohort's secrets on worker processes (shamir.recover_all, aggregator.secret_pool): the same
secrets, the same shares named wrong and the same first refusal as recover() one secret at a time; workers
detached from the terminal that never run the aggregator's program or what its directory holds, end with it,
and, when they cannot start, break or go silent, leave the combining to the aggregator's own process."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from load_factor import budget

from fedmq.aggregator import secret_pool
from fedmq.errors import SecAggError
from fedmq.secagg import shamir

BATCHES = [shamir.combine_each, secret_pool.combine]
IDS = ["in-process", "worker-processes"]
SEVERAL_CORES = pytest.mark.skipif(
    secret_pool.cores() < 2, reason="one core: the aggregator combines in its own process"
)


@pytest.fixture(autouse=True)
def fresh_pool():
    """Every test starts and ends with no workers and none turned off."""

    def reset() -> None:
        with secret_pool._lock:
            if secret_pool._workers is not None:
                secret_pool._kill(secret_pool._workers)
            secret_pool._workers, secret_pool._off, secret_pool._breaks = None, None, 0

    reset()
    yield
    reset()


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


def _rebuilt(requests) -> list[bytes]:
    return [secret for secret, _ in shamir.recover_all(requests, 3, secret_pool.combine)]


@pytest.mark.parametrize("combine_batch", BATCHES, ids=IDS)
def test_recover_all_gives_what_recover_gives_one_by_one(combine_batch):
    secrets, requests = _requests(12, wrong=frozenset({4, 9}))
    workers_cpu = secret_pool._worker_cpu
    got = shamir.recover_all(requests, 3, combine_batch)
    assert got == [shamir.recover(shares, 3, check, what) for shares, check, what in requests]
    assert [secret for secret, _ in got] == secrets
    assert [bad for _, bad in got] == [["a"] if i in {4, 9} else [] for i in range(12)]
    if combine_batch is secret_pool.combine and secret_pool.cores() > 1:  # cpu_time counts the workers'
        assert secret_pool._workers is not None and secret_pool._worker_cpu > workers_cpu


@pytest.mark.parametrize("combine_batch", BATCHES, ids=IDS)
def test_recover_all_refuses_the_first_secret_that_cannot_be_rebuilt(combine_batch):
    _, requests = _requests(6, short=frozenset({2, 5}))
    with pytest.raises(SecAggError, match=r"too-few-shares: secret 2 needs 3 shares, 2 came \(b, c\)"):
        shamir.recover_all(requests, 3, combine_batch)


def _own_cgroup() -> str | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:].strip().lstrip("/")
    return None


def test_the_workers_are_as_many_as_the_cpu_quotas_allow(tmp_path: Path, monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(secret_pool, "_CGROUP", tmp_path)
    assert secret_pool.cores() == min(cpus, secret_pool.MAX_WORKERS)  # no cgroup files: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert secret_pool.cores() == min(cpus, secret_pool.MAX_WORKERS)
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert secret_pool.cores() == min(cpus, 2)
    own = _own_cgroup()
    if own:  # a quota on this process's own cgroup, below one on the root, binds too
        (tmp_path / own).mkdir(parents=True, exist_ok=True)
        (tmp_path / own / "cpu.max").write_text("50000 100000\n")
    else:
        (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert secret_pool.cores() == 1
    assert secret_pool.combine([[(1, bytes(16))]] * 4) == [shamir.combine_points([(1, bytes(16))])] * 4
    assert secret_pool._workers is None and secret_pool._off == "one core"


def _batch(count: int) -> list[shamir.Points]:
    """``count`` distinct share lists (2-of-3 of a random secret each), the last of them not combinable."""
    batch = []
    for _ in range(count - 1):
        shares = shamir.split(os.urandom(shamir.SECRET_BYTES), 2, 3)
        batch.append([(s.index, s.data) for s in shares[1:]])
    return [*batch, [(1, bytes(16)), (1, bytes(16))]]  # one index twice: combine refuses it


@SEVERAL_CORES
def test_the_workers_give_back_each_items_secret_in_its_place():
    batch = _batch(3 * secret_pool.cores() + 2)  # more parts than workers, of unequal sizes
    expected = shamir.combine_each(batch)
    assert expected[-1] is None and all(expected[:-1])
    assert secret_pool.combine(batch) == expected
    assert secret_pool._workers is not None and secret_pool._off is None


@SEVERAL_CORES
def test_workers_live_apart_and_killed_ones_are_replaced_until_they_break_too_often():
    secrets, requests = _requests(8)
    secret_pool.warm()
    workers = secret_pool._workers
    assert workers and all(os.getsid(w.pid) != os.getsid(0) for w in workers)
    assert _rebuilt(requests) == secrets
    for breaks in range(1, secret_pool.MAX_BREAKS + 1):
        workers = secret_pool._workers
        assert workers
        os.kill(workers[0].pid, signal.SIGKILL)  # the first worker always has a part
        workers[0].wait()
        assert _rebuilt(requests) == secrets  # this batch in-process; the other workers are killed too
        assert secret_pool._breaks == breaks and all(w.poll() is not None for w in workers)
        if breaks < secret_pool.MAX_BREAKS:
            assert secret_pool._off is None
            assert _rebuilt(requests) == secrets and secret_pool._workers not in (None, workers)  # new ones
    assert secret_pool._workers is None
    assert f"broke {secret_pool.MAX_BREAKS} times" in (secret_pool._off or "")
    assert _rebuilt(requests) == secrets and secret_pool._workers is None  # and they stay off


@SEVERAL_CORES
def test_a_silent_worker_is_given_up(monkeypatch):
    """A stopped worker never answers: past TIMEOUT_S the batch is combined in-process."""
    monkeypatch.setattr(secret_pool, "TIMEOUT_S", 0.5)
    secrets, requests = _requests(8)
    secret_pool.warm()
    workers = secret_pool._workers
    assert workers
    os.kill(workers[0].pid, signal.SIGSTOP)
    assert _rebuilt(requests) == secrets
    assert secret_pool._breaks == 1 and all(w.poll() is not None for w in workers)


def test_workers_that_cannot_start_leave_the_combining_to_the_aggregator(monkeypatch):
    monkeypatch.setattr(secret_pool, "cores", lambda: 2)
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    secrets, requests = _requests(8)
    assert _rebuilt(requests) == secrets
    assert secret_pool._workers is None and "cannot start" in (secret_pool._off or "")


@SEVERAL_CORES
def test_batches_from_several_threads_each_get_their_own_secrets():
    batches = [_batch(2 * secret_pool.cores() + 1) for _ in range(4)]
    expected = [shamir.combine_each(batch) for batch in batches]
    got: dict[int, list[list[bytes | None]]] = {}

    def run(i: int) -> None:
        got[i] = [secret_pool.combine(batches[i]) for _ in range(10)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(got[i] == [expected[i]] * 10 for i in range(len(batches)))
    assert secret_pool._workers is not None and secret_pool._off is None


def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "program" / "aggregator.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(body))
    return script


@SEVERAL_CORES
def test_workers_run_neither_the_program_nor_what_its_directory_holds(tmp_path: Path):
    """multiprocessing's workers would import the program's main module (a script without a __main__ guard
    runs again in each); `python -m` would import a `fedmq` found in the directory it was started in."""
    marker = tmp_path / "runs"
    script = _script(
        tmp_path,
        f"""
        import os
        from fedmq.aggregator import secret_pool
        from fedmq.secagg import shamir
        with open({str(marker)!r}, "a") as f:
            f.write("run\\n")
        shares = shamir.split(os.urandom(16), 2, 3)
        points = [(s.index, s.data) for s in shares[:2]]
        assert secret_pool.combine([points, points]) == [shamir.combine_points(points)] * 2
        assert secret_pool._workers is not None, secret_pool._off
        """,
    )
    here = tmp_path / "cwd"
    (here / "fedmq").mkdir(parents=True)
    (here / "fedmq" / "__init__.py").write_text("raise SystemExit('the wrong fedmq')\n")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=here, capture_output=True, text=True, timeout=budget(120)
    )
    assert done.returncode == 0, done.stderr
    assert marker.read_text() == "run\n"


@SEVERAL_CORES
@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfd_open is Linux's")
def test_the_workers_end_with_the_aggregator_however_it_ends(tmp_path: Path):
    """A kill -9 of the aggregator closes the workers' stdin: they exit (pidfd: the exit is the event)."""
    script = _script(
        tmp_path,
        """
        import sys
        from fedmq.aggregator import secret_pool
        secret_pool.warm()
        print(*(w.pid for w in secret_pool._workers), flush=True)
        sys.stdin.read()
        """,
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
