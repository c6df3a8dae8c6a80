"""A forged announcement over real RabbitMQ that asks an agent to train for 10⁹ epochs, at lr 1e300 or with
batches of 2⁴⁰ (anyone who can publish to the agent's queue could send it) is rejected by the agent before it
trains: the agent never starts local training and stays in the job."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from load_factor import budget

from fedmq.aggregator.config import JobConfig
from fedmq.broker.transport import topology
from fedmq.broker.transport.connect import connect
from fedmq.broker.transport.provision import purge
from fedmq.broker.wire import messages
from fedmq.client_agent.agent import Agent

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "docs" / "examples"))
from logreg import LogReg  # noqa: E402


@pytest.mark.parametrize("field, value", [("epochs", 10**9), ("lr", 1e300), ("batch_size", 2**40)])
def test_an_agent_rejects_a_round_config_beyond_its_bounds_and_stays(rabbit_url, job_id, field, value):
    started: list[int] = []

    class Watched(Agent):
        def _train(self, model, held, cfg, rnd, crash, **hooks):
            started.append(rnd)
            return super()._train(model, held, cfg, rnd, crash, **hooks)

    admin = connect(rabbit_url)
    admin.declare_job(job_id, ["agent-0"])
    agent = Watched(lambda: connect(rabbit_url), job_id, "agent-0", 0, LogReg(clients=1), heartbeat_s=0.5)
    runner = threading.Thread(target=agent.run, daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + budget(20)
        while not agent.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.connected
        env = messages.announce(job_id, 1, 0, ["agent-0"], JobConfig(job=job_id).round_config(), [])
        env.payload["config"]["train"][field] = value
        admin.publish(topology.rk_announce(job_id, "agent-0"), messages.pack(env), message_id=env.msg_id)
        time.sleep(2.0)
        assert started == [] and agent.last_round == 0
        assert runner.is_alive() and agent.connected
    finally:
        agent.stop.set()
        runner.join(budget(15))
        admin.close()
        purge(rabbit_url, job_id, ["agent-0"])
