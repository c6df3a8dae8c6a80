"""On a private RabbitMQ node: one job's plumbing is out of every other job's reach.

* Each job has its own exchange (``fedmq.<job>``) and its aggregator may configure that one and its job's
  queues only: job jb's aggregator can neither delete job ja's exchange nor bind to it, and ja goes on.
  Before: every job of a vhost shared the exchange ``fedmq`` and every aggregator could configure it; jb's
  aggregator deleted it and stopped every job of the vhost.
* A job's exchange deleted anyway (by its own aggregator's user, or an operator) is reported by name, in
  one line, on both sides; the aggregator's side declares it again and the agents bind their queues again,
  so the job goes on. Before: agents' heartbeats failed silently and the aggregator saw "nobody online"
  forever.
"""

from __future__ import annotations

import threading
import time
import uuid

import pika
import pika.exceptions as pe
import pytest
import structlog
from load_factor import budget

from fedmq.broker.transport import provision as prov
from fedmq.broker.transport import topology as t
from fedmq.broker.transport.admin import CtlAdmin
from fedmq.broker.transport.connect import connect
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.transport.options import ConnectOptions
from fedmq.broker.transport.rabbitmq import RabbitBroker

pytestmark = [pytest.mark.isolated_node]

CTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"


def exchange_of(job: str) -> str:
    """The exchange a job's messages travel through."""
    return t.exchange(job)


def _admin(node) -> CtlAdmin:
    return CtlAdmin(node=node.name, ctl=CTL, env=node.env())


def _refused(url: str, action) -> int:
    """The reply code the broker closes the channel with when ``action(channel)`` runs; 0 if it succeeded."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        action(conn.channel())
        return 0
    except pe.ChannelClosedByBroker as exc:
        return exc.reply_code
    finally:
        conn.close()


def _round_trip(agg, agent, job: str, client: str, tag: str) -> None:
    """The job works: the agent's presence reaches the aggregator's inbox, an announcement reaches it."""
    got: list[bytes] = []
    done = threading.Event()

    def take(d):
        got.append(d.body)
        agg.ack(d)
        done.set()

    ctag = agg.consume(t.q_inbox(job), take)
    try:
        agent.publish(t.rk_presence(job, client), f"presence {tag}".encode())
        assert done.wait(budget(10)), f"presence {tag} never reached the aggregator"
    finally:
        agg.cancel(ctag)
    assert got == [f"presence {tag}".encode()]
    agg.publish(t.rk_announce(job, client), f"announce {tag}".encode())
    with agent.subscribe(t.q_latest(job, client)) as sub:
        d = sub.next(10)
        assert d is not None and d.body == f"announce {tag}".encode()
        sub.ack(d)


def test_one_jobs_aggregator_cannot_touch_another_jobs_exchange(rabbit_node):
    tag = uuid.uuid4().hex[:6]
    vhost, ja, jb = f"fedmq-plumb-{tag}", f"ja{tag}", f"jb{tag}"
    admin = _admin(rabbit_node)
    a = prov.provision(rabbit_node.url, vhost=vhost, job=ja, agents=["agent-0"], admin=admin)
    b = prov.provision(rabbit_node.url, vhost=vhost, job=jb, agents=["agent-0"], admin=admin)
    try:
        with (
            connect(a["aggregator"]["url"]) as agg_a,
            connect(a["agents"]["agent-0"]["url"]) as a0,
            connect(b["aggregator"]["url"]) as agg_b,
        ):
            agg_a.declare_job(ja, [], model_bytes=1000)
            a0.declare_job(ja, ["agent-0"], inbox=False)
            agg_b.declare_job(jb, [], model_bytes=1000)
            _round_trip(agg_a, a0, ja, "agent-0", "before")
            jb_url = b["aggregator"]["url"]
            ex_a, ex_b = exchange_of(ja), exchange_of(jb)
            assert ex_a != ex_b
            # jb's aggregator may neither delete ja's exchange, nor bind its own queue to it (to hear ja's
            # announcements), nor bind ja's exchange to its own (the same, exchange to exchange)
            assert _refused(jb_url, lambda ch: ch.exchange_delete(ex_a)) == 403
            assert _refused(jb_url, lambda ch: ch.queue_bind(t.q_inbox(jb), ex_a, routing_key="#")) == 403
            assert _refused(jb_url, lambda ch: ch.exchange_bind(ex_b, ex_a, routing_key="#")) == 403
            # nor redeclare it with other properties (403 before the 406 of an inequivalent declare)
            assert _refused(jb_url, lambda ch: ch.exchange_declare(ex_a, exchange_type="fanout")) == 403
            # nothing any job uses in common is configurable by a job's user
            for creds in (a, b):
                for entry in [creds["aggregator"], *creds["agents"].values()]:
                    assert _refused(entry["url"], lambda ch: ch.exchange_delete(t.LEGACY_EXCHANGE)) == 403
            # and ja keeps running
            _round_trip(agg_a, a0, ja, "agent-0", "after")
            # jb's aggregator can still delete its own job's exchange: only its own job stops
            assert _refused(jb_url, lambda ch: ch.exchange_delete(ex_b)) == 0
            _round_trip(agg_a, a0, ja, "agent-0", "after jb lost its own")
    finally:
        for creds in (a, b):
            admin.delete_users(
                [creds["aggregator"]["username"], *(e["username"] for e in creds["agents"].values())]
            )
        admin.delete_vhost(vhost)


def _errors(logs: list[dict], needle: str) -> list[dict]:
    return [e for e in logs if e.get("log_level") == "error" and needle in e.get("event", "")]


def test_a_deleted_exchange_is_named_and_the_job_goes_on(rabbit_node, job_id):
    url, client = rabbit_node.url, "agent-0"
    ex = exchange_of(job_id)
    agg = RabbitBroker(url, ConnectOptions(exchange_check_s=0.5))
    agent = RabbitBroker(url, ConnectOptions(exchange_check_s=0.5))
    try:
        agg.declare_job(job_id, [], model_bytes=1000)
        agent.declare_job(job_id, [client], inbox=False)
        _round_trip(agg, agent, job_id, client, "before")
        with structlog.testing.capture_logs() as logs:
            assert _refused(url, lambda ch: ch.exchange_delete(ex)) == 0
            with pytest.raises(BrokerError) as exc:
                agent.publish(t.rk_presence(job_id, client), b"into the void")
            line = str(exc.value)
            assert "\n" not in line and f"exchange {ex!r} of job {job_id!r} does not exist" in line, line
            # both sides report it by name, once each, without publishing anything (the aggregator's watch)
            deadline = time.monotonic() + budget(10)
            while len(_errors(logs, f"exchange {ex!r}")) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(_errors(logs, f"exchange {ex!r}")) == 2, logs
            # the aggregator's side declares it again after 3 checks, the agent's side binds its queues again
            # (the agent may see the exchange back before the aggregator's thread has said it declared it)
            deadline = time.monotonic() + budget(20)
            wanted = ("declared the job's missing exchange again", "queues are bound again")
            while time.monotonic() < deadline and not all(
                any(w in e.get("event", "") for e in logs) for w in wanted
            ):
                time.sleep(0.1)
        events = [e.get("event", "") for e in logs]
        assert "declared the job's missing exchange again" in events, events
        assert "the job's exchange is back: its queues are bound again" in events, events
        _round_trip(agg, agent, job_id, client, "after")
    finally:
        agent.close()
        agg.close()
        for q in (t.q_inbox(job_id), t.q_dead(job_id), t.q_models(job_id), t.q_latest(job_id, client)):
            _refused(url, lambda ch, q=q: ch.queue_delete(q))
        _refused(url, lambda ch: ch.queue_delete(t.q_control(job_id, client)))
