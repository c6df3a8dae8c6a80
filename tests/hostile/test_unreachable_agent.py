"""On a private RabbitMQ node: an agent that deletes its own ``latest`` queue (on purpose or by accident) and
keeps sending presence cannot stop the job. The aggregator selects it, the announce comes back unroutable
(``mandatory``): the agent loses its place in the round, named in the round's record with the reason, and the
job goes on. A restarted aggregator that resumes a round listing the agent as selected finds out again
(its re-announce is unroutable too) and finishes the job. Before: the unroutable announce ended
``fedmq aggregator run``, and every restart re-announced the saved round and died the same way."""

from __future__ import annotations

import threading
import time

import pika
import pytest
from load_factor import budget

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.engine import Engine
from fedmq.broker.transport import topology
from fedmq.broker.transport.connect import connect
from fedmq.broker.wire import messages
from fedmq.client_agent.agent import Agent

pytestmark = [pytest.mark.isolated_node]

HOSTILE = "agent-2"


@pytest.fixture(scope="module")
def task(tiny_lm):
    return tiny_lm(3)


def _cfg(job: str, rounds: int) -> JobConfig:
    return JobConfig(
        job=job,
        rounds=rounds,
        clients=3,
        fraction=1.0,
        lr=1.0,
        max_steps=2,
        batch_size=4,
        heartbeat_s=0.5,
        join_timeout_s=30,
        report_deadline_s=60,
        update_deadline_s=30,
        identity="shared:guest",
    )


def _delete_queue(url: str, queue: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        conn.channel().queue_delete(queue)
    finally:
        conn.close()


class Heartbeats:
    """The hostile agent's presence (online, every 0.5 s) from its own connection, with no queue of its own
    left to hear from the aggregator."""

    def __init__(self, url: str, job: str) -> None:
        self.broker = connect(url)
        self.job = job
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while not self.stop.is_set():
            env = messages.presence(self.job, HOSTILE, "online", messages.NO_VERSION)
            self.broker.publish(
                topology.rk_presence(self.job, HOSTILE), messages.encode(env), message_id=env.msg_id
            )
            self.stop.wait(0.5)

    def __enter__(self) -> Heartbeats:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=budget(10))
        self.broker.close()


def _honest_agents(url: str, job: str, task) -> list[Agent]:
    return [
        Agent(lambda: connect(url), job, f"agent-{i}", i, task, heartbeat_s=0.5, rejoin_s=0.2) for i in (0, 1)
    ]


def _run_agents(agents: list[Agent]) -> list[threading.Thread]:
    threads = [threading.Thread(target=a.run, daemon=True) for a in agents]
    for t in threads:
        t.start()
    return threads


def _stop_agents(agents: list[Agent], threads: list[threading.Thread]) -> None:
    for a in agents:
        a.stop.set()
    for t in threads:
        t.join(timeout=budget(10))


def _check_rows(rows) -> None:
    assert [r.round for r in rows] == list(range(1, len(rows) + 1))
    for row in rows:
        assert not row.skipped, row.skip_reason
        assert row.selected == ("agent-0", "agent-1") and row.received == ("agent-0", "agent-1")
        assert list(row.unreachable) == [HOSTILE] and "unroutable" in row.unreachable[HOSTILE]


def test_an_agent_that_deleted_its_queue_loses_its_place_not_the_job(rabbit_node, job_id, task, tmp_path):
    url = rabbit_node.url
    admin = connect(url)
    admin.declare_job(job_id, [HOSTILE], inbox=False)  # the hostile agent joined once ...
    engine = Engine(connect(url), task, _cfg(job_id, 2), tmp_path / "run", durable=False, evaluate=False)
    engine.declare()
    _delete_queue(url, topology.q_latest(job_id, HOSTILE))  # ... and deleted its latest queue
    agents = _honest_agents(url, job_id, task)
    with Heartbeats(url, job_id):
        threads = _run_agents(agents)
        try:
            summary = engine.run()
        finally:
            _stop_agents(agents, threads)
            engine.broker.close()
            admin.close()
    assert summary["rounds_completed"] == 2 and summary["rounds_skipped"] == 0
    _check_rows(engine.runlog.rows())


def test_a_restarted_aggregator_checks_again_who_is_reachable(rabbit_node, job_id, task, tmp_path):
    url = rabbit_node.url
    admin = connect(url)
    admin.declare_job(job_id, [HOSTILE], inbox=False)  # reachable when round 1 is announced
    cfg, run_dir = _cfg(job_id, 2), tmp_path / "run"
    first = Engine(connect(url), task, cfg, run_dir, durable=False, evaluate=False)
    first.declare()
    agents = _honest_agents(url, job_id, task)
    with Heartbeats(url, job_id):
        threads = _run_agents(agents)
        try:
            runner = threading.Thread(target=first.run, daemon=True)
            runner.start()
            deadline = time.monotonic() + budget(60)
            while not (first.round == 1 and first.phase == "training") and time.monotonic() < deadline:
                time.sleep(0.01)
            assert first.phase == "training", "round 1 was never announced"
            # round 1 is announced to all three and saved so; then the agent deletes its queue, and the
            # aggregator stops with the round open (as a crash or a deploy would leave it)
            _delete_queue(url, topology.q_latest(job_id, HOSTILE))
            first.stop.set()
            runner.join(timeout=budget(30))
            first.broker.close()
            assert first.runlog.rows() == []  # round 1 is still open
            second = Engine(connect(url), task, cfg, run_dir, durable=False, evaluate=False)
            summary = second.run()  # resumes round 1: its re-announce to the agent is unroutable
        finally:
            _stop_agents(agents, threads)
            admin.close()
    second.broker.close()
    assert summary["rounds_completed"] == 2 and summary["rounds_skipped"] == 0, summary
    _check_rows(second.runlog.rows())
    # no round waited for the unreachable agent's report until its deadline
    assert all(r.wall_s < cfg.report_deadline_s for r in second.runlog.rows()), second.runlog.rows()
