"""A job's exchange deleted under a running aggregator (by an administrator, on the shared broker in a
vhost of this test's own): the aggregator's publish waits until its side has declared the exchange again,
with its bindings, and goes; it does not fail (the aggregator would exit). An agent's publish meanwhile
still fails with the one line naming the exchange: only the aggregator may declare it."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid

import pika
import pytest

from fedmq.broker.transport import topology as t
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.options import ConnectOptions
from fedmq.broker.transport.rabbitmq import RabbitBroker

pytestmark = pytest.mark.rabbitmq


def ctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60, check=True)


@pytest.fixture
def vhost_url(rabbit_url):
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not on this machine")
    vhost = "fedmq-redeclare-" + uuid.uuid4().hex[:8]
    try:
        ctl("add_vhost", vhost)
        ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"rabbitmqctl cannot administer the test broker: {exc}")
    yield f"amqp://guest:guest@127.0.0.1:5672/{vhost}"
    ctl("delete_vhost", vhost)


def test_the_aggregators_publish_waits_for_its_deleted_exchange_and_goes(vhost_url, job_id):
    client = "agent-0"
    agg = RabbitBroker(vhost_url, ConnectOptions(exchange_check_s=0.5))
    agent = RabbitBroker(vhost_url, ConnectOptions(exchange_check_s=0.5, presence_lane=False))
    try:
        agg.declare_job(job_id, [], model_bytes=1000)
        agent.declare_job(job_id, [client], inbox=False)
        with pika.BlockingConnection(pika.URLParameters(vhost_url)) as conn:
            conn.channel().exchange_delete(t.exchange(job_id))
        with pytest.raises(BrokerError, match=f"exchange '{t.exchange(job_id)}' of job '{job_id}' does not"):
            agent.publish(t.rk_update(job_id, client), b"into the void")
        start = time.monotonic()
        # declared again, with the model stream's binding: routed (an unroutable publish raises Undeliverable)
        agg.publish(t.rk_model(job_id), b"the model, after")
        assert time.monotonic() - start < 4 * 0.5 + 5
        deadline = time.monotonic() + 10  # the agent's side binds its queues again once it is back
        while True:
            try:
                agent.publish(t.rk_update(job_id, client), b"an update, after")
                break
            except BrokerError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert agg.queue_depth(t.q_inbox(job_id)) == 1
    finally:
        agent.close()
        agg.close()
