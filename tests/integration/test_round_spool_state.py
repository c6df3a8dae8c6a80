"""What a synchronous round's spool says of it (aggregator/sync_round.py, ``_save``): a report that arrives
after the grant is recorded without erasing the grant, so a restart publishes the same grant instead of
mediating again (and granting others than the agents that trained for it)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from load_factor import budget

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.engine import Engine
from fedmq.aggregator.spool import RoundSpool
from fedmq.broker.transport import topology
from fedmq.broker.transport.connect import connect
from fedmq.broker.wire import messages

AGENTS = [f"agent-{i}" for i in range(4)]


@pytest.fixture(scope="module")
def task(tiny_lm):
    return tiny_lm(len(AGENTS))


def _wait(what, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + budget(timeout)
    while not what() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert what()


def _spooled(run: Path) -> dict:
    """Round 1's state as a restart would read it (its report log included)."""
    return RoundSpool(run / "spool").load(1)[0] or {}


def test_a_report_after_the_grant_keeps_the_grant_in_the_spool(task, tmp_path):
    job, run = "late-report", tmp_path / "run"
    url = f"memory://{job}"
    admin = connect(url)
    admin.declare_job(job, AGENTS)
    cfg = JobConfig(
        job=job,
        strategy="fedavg",
        rounds=1,
        clients=len(AGENTS),
        fraction=1.0,
        beta=0.5,  # top-K: a grant phase
        heartbeat_s=600,
        join_timeout_s=600,
        report_deadline_s=600,
        update_deadline_s=600,
        identity="shared:guest",
    )
    broker = connect(url, user=topology.AGGREGATOR_USER)
    engine = Engine(broker, task, cfg, run, durable=False, evaluate=False)
    runner = threading.Thread(target=engine.run, daemon=True)
    runner.start()
    for client in AGENTS:
        env = messages.presence(job, client, "online", -1)
        admin.publish(topology.rk_presence(job, client), messages.encode(env), message_id=env.msg_id)
    _wait(lambda: engine.phase == "training" and engine.round == 1)
    late = AGENTS[-1]
    for i, client in enumerate(AGENTS[:-1]):
        env = messages.report(job, 1, client, 0, 1.0 + i, 10)
        admin.publish(topology.rk_report(job, client), messages.encode(env), message_id=env.msg_id)
    # the late agent says it went offline: the round mediates without it, deadline or not
    env = messages.presence(job, late, "offline", -1)
    admin.publish(topology.rk_presence(job, late), messages.encode(env), message_id=env.msg_id)
    _wait(lambda: engine.phase == "uploading")  # mediated without the late agent: the grant is out
    granted = _spooled(run)["granted"]
    assert granted and late not in granted
    env = messages.report(job, 1, late, 0, 0.5, 10)
    admin.publish(topology.rk_report(job, late), messages.encode(env), message_id=env.msg_id)
    _wait(lambda: late in _spooled(run).get("reported", {}))
    state = _spooled(run)
    assert state["granted"] == granted and state["strategy"] == "fedavg" and state["closed"] is False
    engine.stop.set()
    runner.join(timeout=budget(60))
    assert not runner.is_alive()
