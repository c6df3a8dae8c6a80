"""On a private RabbitMQ node: bounds the transport keeps before a message's bytes are held, presence apart
from uploads, and an end to retrying what the broker's permissions refuse.

* A message whose content header announces more bytes than the consumer accepts is refused (dead-lettered)
  from that header: its body frames are dropped as they arrive. Before: it was received whole (an
  unchunked body went to the handler at any size).
* A heartbeat published while the same agent's upload is on the wire is confirmed before the upload is.
  Before: it waited in the connection's command queue behind every chunk of the upload.
* An agent whose presence is refused by its topic permissions ends with one line after a bounded number of
  tries. Before: it retried every 10 s forever.
"""

from __future__ import annotations

import threading
import time
import tracemalloc
import uuid

import pytest
from load_factor import budget

from fedmq.broker.transport import provision as prov
from fedmq.broker.transport import topology as t
from fedmq.broker.transport.admin import CtlAdmin
from fedmq.broker.transport.base import ReassemblyLimits
from fedmq.broker.transport.connect import connect
from fedmq.broker.transport.errors import REFUSAL_TRIES, BrokerError
from fedmq.broker.transport.options import ConnectOptions
from fedmq.broker.transport.rabbitmq import RabbitBroker
from fedmq.client_agent.agent import Agent
from fedmq.tasks.lm import LanguageModelTask

pytestmark = [pytest.mark.isolated_node]

CTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"
MiB = 1024 * 1024


def test_an_oversized_message_is_refused_from_its_header(rabbit_node, job_id):
    url = rabbit_node.url
    big = 12 * MiB  # under the node's max_message_size (16 MiB), far over the consumer's limit (1 MiB)
    with RabbitBroker(url, ConnectOptions(chunk_limit=32 * MiB)) as sender:  # one unchunked message
        sender.declare_job(job_id, [], model_bytes=1000)
        sender.publish(t.rk_update(job_id, "agent-0"), b"\x00" * big, message_id="bomb")
        sender.publish(t.rk_update(job_id, "agent-0"), b"honest", message_id="honest")
    got: list[tuple[str | None, int]] = []
    done = threading.Event()
    with RabbitBroker(url) as consumer:
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]

            def take(d):
                got.append((d.message_id, len(d.body)))
                consumer.ack(d)
                if d.message_id == "honest":
                    done.set()

            consumer.consume(t.q_inbox(job_id), take, reassembly=ReassemblyLimits(max_message_size=MiB))
            assert done.wait(budget(30))
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        deadline = time.monotonic() + budget(10)
        while consumer.queue_depth(t.q_dead(job_id)) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert consumer.queue_depth(t.q_dead(job_id)) == 1  # refused: dead-lettered for the operator
    assert got == [("honest", 6)]  # the oversized one never reached the handler
    assert peak < 4 * MiB, f"{peak / MiB:.1f} MiB held while refusing a {big / MiB:.0f} MiB message"


def test_presence_is_not_queued_behind_an_upload(rabbit_node, job_id):
    url = rabbit_node.url
    # 1024 chunks of 32 KiB, 8 in flight: about 130 confirm round trips of a quorum queue, seconds on the wire
    body = b"\x01" * (32 * MiB)
    with (
        RabbitBroker(url, ConnectOptions(chunk_limit=32 * 1024, prefetch=2048)) as agent,
        RabbitBroker(url) as watcher,
    ):
        agent.declare_job(job_id, [], model_bytes=1000)
        agent.publish(t.rk_presence(job_id, "agent-0"), b"warm")  # connections open before timing
        times: dict[str, float] = {}

        def upload() -> None:
            agent.publish(t.rk_update(job_id, "agent-0"), body, message_id="upload")
            times["upload"] = time.monotonic()

        th = threading.Thread(target=upload)
        th.start()
        # the heartbeat goes once the upload's first chunks are in the inbox (beside "warm"), whatever the
        # machine's speed: a fixed pause let a fast machine finish the whole upload first
        deadline = time.monotonic() + budget(30)
        while watcher.queue_depth(t.q_inbox(job_id)) < 9 and "upload" not in times:
            assert time.monotonic() < deadline, "no chunk of the upload reached the inbox"
            time.sleep(0.01)
        sent = time.monotonic()
        assert "upload" not in times, "the upload finished before the heartbeat: make it larger"
        agent.publish(t.rk_presence(job_id, "agent-0"), b"beat", message_id="beat")
        times["presence"] = time.monotonic()
        th.join(budget(120))
        assert "upload" in times
        assert times["presence"] < times["upload"], (
            f"heartbeat confirmed {times['presence'] - sent:.2f} s after it was sent, "
            f"{times['presence'] - times['upload']:.2f} s after the upload"
        )
        assert agent.queue_depth(t.q_inbox(job_id)) >= 2


def test_an_agent_refused_by_its_permissions_ends_with_one_line(rabbit_node):
    tag = uuid.uuid4().hex[:6]
    vhost, job = f"fedmq-refused-{tag}", f"jr{tag}"
    admin = CtlAdmin(node=rabbit_node.name, ctl=CTL, env=rabbit_node.env())
    creds = prov.provision(rabbit_node.url, vhost=vhost, job=job, agents=["agent-0"], admin=admin)
    try:
        with connect(creds["aggregator"]["url"]) as agg:
            agg.declare_job(job, [], model_bytes=1000)
        # the agent may publish its reports and updates, not its presence (an operator's mistake, for good)
        p = prov.agent_permissions(job, "agent-0")
        admin.run(
            "set_topic_permissions",
            "-p",
            vhost,
            t.agent_user(job, "agent-0"),
            p.exchange,
            p.topic_write.replace("|presence", ""),
            p.topic_read,
        )
        tiny = dict(data="builtin", model="gru-small", emb=8, hidden=8, vocab_size=100, max_lines=50)
        task = LanguageModelTask(clients=1, seed=0, **tiny)
        url = creds["agents"]["agent-0"]["url"]
        agent = Agent(lambda: connect(url), job, "agent-0", 0, task, heartbeat_s=30, rejoin_s=0.2)
        outcome: list[BaseException] = []

        def run() -> None:
            try:
                agent.run()
            except BaseException as exc:
                outcome.append(exc)

        th = threading.Thread(target=run, daemon=True)
        th.start()
        th.join(budget(60))
        if th.is_alive():
            agent.stop.set()
            th.join(budget(30))
            pytest.fail(f"the agent was still retrying a refused publish after {budget(60):.0f} s")
        assert len(outcome) == 1 and isinstance(outcome[0], BrokerError), outcome
        exc = outcome[0]
        line = str(exc)
        assert exc.permanent and "\n" not in line, line
        assert "403" in line and f"refused {REFUSAL_TRIES} times in a row" in line, line
    finally:
        admin.delete_users(
            [creds["aggregator"]["username"], *(e["username"] for e in creds["agents"].values())]
        )
        admin.delete_vhost(vhost)
