"""Hosts: two processes' worth of clients (two Hosts over the in-process broker) share a federation, and the
aggregator takes a hosted client's word only from its host.

Before the hosts join, forged messages arrive: a roster from a user that is not the host's, a report for one
host's client from the other host's user, and a roster that names clients past the job's population. Each is
refused with its reason; then the rounds run, every selected client trains in its host and is folded."""

from __future__ import annotations

import threading
import time

import pytest
from load_factor import budget

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.engine import Engine
from fedmq.broker.transport import topology
from fedmq.broker.transport.connect import connect
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.wire import messages
from fedmq.client_agent.host import Host

HOSTS = {"h0": [(0, 4)], "h1": [(4, 8)]}


def _job(job: str, **settings) -> JobConfig:
    """A small job of three rounds, raw encodings, one local step of batch 2 unless ``settings`` say else."""
    base = dict(encoding="raw", down_encoding="raw", strategy="fedavg", rounds=3, max_steps=1, batch_size=2)
    return JobConfig(job=job, heartbeat_s=0.5, join_timeout_s=20, **{**base, **settings})


def _publish(url: str, user: str, env) -> None:
    broker = connect(url, user=user)
    try:
        broker.publish(topology.rk_presence(env.job, env.client), messages.encode(env), message_id=env.msg_id)
    finally:
        broker.close()


def _simulate(cfg: JobConfig, task, tmp_path):
    """A Simulation of ``cfg`` over the in-process broker, run to its end: (the simulation, its summary, the
    threads it added to the test process's own at each round's end). A worker's earlier tests may leave
    threads behind: the count starts from what is running now."""
    from fedmq.simulation import Simulation

    before, threads = threading.active_count(), []
    sim = Simulation(
        cfg,
        task,
        f"memory://{cfg.job}-{time.monotonic_ns()}",
        run_dir=tmp_path / "run",
        on_round=lambda row: threads.append(threading.active_count() - before),
    )
    return sim, sim.run(), threads


def test_two_hosts_run_a_population_and_speak_only_for_their_own_clients(tiny_lm, tmp_path):
    job = "hosts"
    url = f"memory://{job}-{time.monotonic_ns()}"
    task = tiny_lm(8)
    cfg = _job(job, clients=8, fraction=0.5, lr=5.0, max_steps=2, batch_size=4)

    def h0_speaks_for_h1(row: dict) -> None:  # once both hosts are known: h0 reports for h1's client
        if row["round"] == 1:
            env = messages.report(job, 2, "h1-5", row["version"], 1.0, 3)
            broker = connect(url, user=topology.host_user(job, "h0"))
            broker.publish(topology.rk_report(job, env.client), messages.encode(env), message_id=env.msg_id)
            broker.close()
            # a third host serving client number 2, which h0 serves: the same shard twice
            h7 = messages.host_presence(job, "h7", "online", [(2, 3)])
            _publish(url, topology.host_user(job, "h7"), h7)

    run_dir = tmp_path / "run"
    broker = connect(url, user=topology.AGGREGATOR_USER)
    engine = Engine(broker, task, cfg, run_dir, durable=False, on_round=h0_speaks_for_h1)
    engine.declare()
    # a client's user posing as its host; a host naming clients past the population (8)
    _publish(url, f"{job}.h0-1", messages.host_presence(job, "h0", "online", [(0, 4)]))
    _publish(url, topology.host_user(job, "h9"), messages.host_presence(job, "h9", "online", [(0, 100)]))
    hosts = [
        Host(
            lambda name=name: connect(url, user=topology.host_user(job, name)),
            job,
            name,
            ranges,
            task,
            heartbeat_s=cfg.heartbeat_s,
            rejoin_s=0.2,
        )
        for name, ranges in HOSTS.items()
    ]
    threads = [threading.Thread(target=h.run, daemon=True) for h in hosts]
    for t in threads:
        t.start()
    try:
        summary = engine.run()
    finally:
        for h in hosts:
            h.stop.set()
        for t in threads:
            t.join(timeout=budget(10))
    assert summary["rounds_completed"] == 3
    assert engine.hosted["h1-5"] == "h1"  # so h0's report for it was a forgery, not an unknown client
    assert engine.inbox.rejected["identity-mismatch"] == 2
    assert engine.inbox.dropped["roster-past-population"] >= 1
    assert engine.inbox.dropped["clients-served-twice"] == 1 and "h7-2" not in engine.hosted
    rows = engine.runlog.rows()
    every = {f"h0-{n}" for n in range(4)} | {f"h1-{n}" for n in range(4, 8)}
    for row in rows:
        assert set(row.online) == every
        assert len(row.selected) == 4 and set(row.received) == set(row.selected)
    trained = {c for h in hosts for c, log in h.logs.items() if log.uploads}
    assert trained == {c for row in rows for c in row.selected}
    assert all(h.finished for h in hosts)  # the job's end reached both hosts


def test_client_numbers_parse_to_ranges_and_bad_ones_are_one_line():
    assert topology.parse_clients("0-2499,5000,6000-6099") == [(0, 2500), (5000, 5001), (6000, 6100)]
    for bad, why in (("3-1", "empty"), ("a", "want N"), ("0-5,4", "overlap"), ("", "want N")):
        with pytest.raises(ValueError, match=why):
            topology.parse_clients(bad)


def test_a_simulated_population_has_no_thread_per_client_and_two_queues(tiny_lm, tmp_path):
    """5,000 simulated clients: the process runs about as many threads as a population of 5 would (a client
    has a thread only while selected), the broker holds the job's three queues and the one host's two, and
    every selected client trains."""
    cfg = _job("many", clients=5000, fraction=0.001, lr=5.0)
    sim, summary, added = _simulate(cfg, tiny_lm(5000), tmp_path)
    assert summary["rounds_completed"] == 3 and summary["uploads_confirmed"] == 3 * 5
    assert summary["broker_queues"] == 3 + 2
    assert max(added) < 40, added
    rows = sim.engine.runlog.rows()
    assert all(r.online_count == 5000 and r.online == () for r in rows)  # a count, not 5,000 names a row
    assert {c for r in rows for c in r.received} == {c for c, log in sim.agent_logs.items() if log.uploads}


def test_asynchronous_rounds_take_turns_past_the_clients_a_host_runs_at_once(tiny_lm, tmp_path):
    """Asynchronous mode trains every client online, each version: past ASYNC_AT_ONCE a host's clients take
    turns (a thread each only while training), so 200 clients run with at most 64 threads, and every
    version is folded from the updates that arrive."""
    from fedmq.client_agent.host import ASYNC_AT_ONCE

    cfg = _job("turns", strategy="async", clients=200, strategy_args={"buffer_size": 20}, lr=1.0)
    sim, summary, added = _simulate(cfg, tiny_lm(200), tmp_path)
    assert summary["version"] == 3
    assert max(added) < ASYNC_AT_ONCE + 30, added
    trained = [c for c, log in sim.agent_logs.items() if log.uploads]
    assert len(trained) >= 3 * 20 // 2  # the turns went round: many clients, not the same few


def test_an_asynchronous_host_trains_again_once_its_lost_connection_is_back(tiny_lm, tmp_path):
    """The host's connection goes while all its clients train: every running client loses its round.
    Nothing will announce that version again (the aggregator already did), so once the host is back its
    clients that have not trained from the newest version take their turns from it, and the job goes on."""
    from fedmq.tasks.lm import LanguageModelTask

    class Slow(LanguageModelTask):
        def train(self, *args, **kwargs):
            time.sleep(0.5)  # long enough for the test to cut the connection under every running client
            return super().train(*args, **kwargs)

    job = "rejoin"
    url = f"memory://{job}-{time.monotonic_ns()}"
    task = tiny_lm(4, Slow)
    cfg = _job(job, strategy="async", clients=4, strategy_args={"buffer_size": 4}, rounds=2, lr=1.0)
    engine = Engine(connect(url, user=topology.AGGREGATOR_USER), task, cfg, tmp_path / "run", durable=False)
    engine.declare()
    down_until = [0.0]

    def connect_host():  # the broker cannot be reached for a while after the cut: the uploads find no way
        if time.monotonic() < down_until[0]:
            raise BrokerError("connection refused")
        return connect(url, user=topology.host_user(job, "h0"))

    host = Host(connect_host, job, "h0", [(0, 4)], task, heartbeat_s=cfg.heartbeat_s, rejoin_s=0.2)
    cut: list[int] = []

    def cut_under_the_running_clients() -> None:
        deadline = time.monotonic() + budget(30)
        while time.monotonic() < deadline and len(host._running) < 4:
            time.sleep(0.01)
        broker = host._broker
        if broker is not None and len(host._running) == 4:
            cut.append(len(host._running))
            down_until[0] = time.monotonic() + 1.5
            broker.close()

    summary: dict = {}
    threads = [
        threading.Thread(target=host.run, daemon=True),
        threading.Thread(target=cut_under_the_running_clients, daemon=True),
        threading.Thread(target=lambda: summary.update(engine.run()), daemon=True),
    ]
    for t in threads:
        t.start()
    # about 4 s on an idle machine; the deadlines (60 s and more) would be a stall, so never as long as those
    threads[2].join(timeout=min(budget(20), 50))
    stalled = threads[2].is_alive()
    engine.stop.set()
    host.stop.set()
    threads[0].join(timeout=budget(10))
    assert cut == [4], "the connection was not cut while every client trained"
    assert not stalled and summary["version"] == 2, summary
    lost = [c for c, log in host.logs.items() if 1 not in [r for r, _ in log.uploads]]
    assert lost == [], lost  # each client trained version 0 again and uploaded it after the reconnect
