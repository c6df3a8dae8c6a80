"""On the shared RabbitMQ, with the job's own credentials: one host's user floods the aggregator's inbox with
presence, and a host speaks for a client outside its roster (a phantom id past the population).

The flood (as fast as one connection publishes, for at most FLOOD_S seconds or FLOOD_MESSAGES messages)
starts while the engine is busy and goes on while an honest host of POPULATION clients and two one-client
agents train: every round still selects and folds its honest clients, nothing honest is dropped as stale, and
the flooder is named (one log line per window, and in the engine's status). The phantom's presence is refused
with its reason and it is never online nor selected."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid

import pytest
from load_factor import budget
from structlog.testing import capture_logs

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.engine import Engine
from fedmq.broker.transport import provision as prov
from fedmq.broker.transport import topology as t
from fedmq.broker.transport.admin import CtlAdmin
from fedmq.broker.transport.connect import connect
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.wire import messages
from fedmq.client_agent.agent import Agent
from fedmq.client_agent.host import Host

pytestmark = pytest.mark.rabbitmq

HONEST = ("a0", "a1")
POPULATION = 3000  # the honest host h1 serves them all
FLOOD_S = 5.0
FLOOD_MESSAGES = 20_000
BUSY_S = 2.0


@pytest.fixture
def creds(rabbit_url, job_id):
    """A fresh vhost with the job's aggregator, the one-client agents and hosts h0 (hostile) and h1, removed
    afterwards."""
    vhost = f"fedmqt-{uuid.uuid4().hex[:8]}"
    admin = CtlAdmin()
    creds = prov.provision(
        rabbit_url, vhost=vhost, job=job_id, agents=list(HONEST), hosts=["h0", "h1"], admin=admin
    )
    yield creds
    users = [creds["aggregator"]["username"], *(e["username"] for e in creds["hosts"].values())]
    admin.delete_users(users + [e["username"] for e in creds["agents"].values()])
    admin.delete_vhost(vhost)


def _cfg(job: str, rounds: int, clients: int, **settings) -> JobConfig:
    base = dict(encoding="raw", down_encoding="raw", strategy="fedavg", max_steps=1, batch_size=2, lr=1.0)
    return JobConfig(
        job=job,
        rounds=rounds,
        clients=clients,
        # a presence counts for three beats; on a busy machine the engine reads a flood's backlog more slowly,
        # and an honest host's beat queued behind it must still be read within its window (three beats: 3 s on
        # an idle machine, while the flood lasts FLOOD_S)
        heartbeat_s=budget(1.0),
        join_timeout_s=20,
        report_deadline_s=8,
        update_deadline_s=8,
        **{**base, **settings},
    )


# the flooder: a process of its own (the engine's GIL does not slow it), one channel, no confirms
FLOODER = """
import sys, time, pika
url, exchange, key, user, body = sys.argv[1:6]
seconds, most = float(sys.argv[6]), int(sys.argv[7])
conn = pika.BlockingConnection(pika.URLParameters(url))
ch = conn.channel()
props = pika.BasicProperties(user_id=user, delivery_mode=2)
body = bytes.fromhex(body)
sent, end = 0, time.monotonic() + seconds
while sent < most and time.monotonic() < end:
    ch.basic_publish(exchange, key, body, props)
    sent += 1
conn.close()
print(sent)
"""


class Flood:
    """Host h0's user publishing ``body`` on h0's presence key as fast as one channel can, for at most
    FLOOD_S seconds or FLOOD_MESSAGES messages (a process of its own)."""

    def __init__(self, url: str, job: str, body: bytes) -> None:
        self.args = [url, t.exchange(job), t.rk_presence(job, "h0"), t.host_user(job, "h0"), body.hex()]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        argv = [sys.executable, "-c", FLOODER, *self.args, str(FLOOD_S), str(FLOOD_MESSAGES)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)

    def sent(self) -> int:
        """Wait for the flood to end; how many messages it published."""
        assert self.proc is not None, "the flood never started"
        out, _ = self.proc.communicate(timeout=FLOOD_S + 30)
        return int(out.strip() or 0)


def _run(creds, cfg: JobConfig, task, tmp_path, on_round, host: bool) -> Engine:
    """The engine, the one-client agents and (``host``) host h1 serving the population, over their
    provisioned users, run to the job's end."""
    engine = Engine(
        connect(creds["aggregator"]["url"]), task, cfg, tmp_path / "run", durable=False, evaluate=False
    )
    engine.on_round = lambda row: on_round(engine, row)
    engine.declare()
    beat = dict(heartbeat_s=cfg.heartbeat_s, rejoin_s=0.2)
    honest: list[Agent | Host] = [
        Agent(lambda c=c: connect(creds["agents"][c]["url"]), cfg.job, c, i, task, **beat)
        for i, c in enumerate(HONEST)
    ]
    if host:
        url = creds["hosts"]["h1"]["url"]
        honest.append(Host(lambda: connect(url), cfg.job, "h1", [(0, cfg.clients)], task, **beat))
    threads = [threading.Thread(target=a.run, daemon=True) for a in honest]
    for th in threads:
        th.start()
    try:
        engine.run()
    finally:
        for a in honest:
            a.stop.set()
        for th in threads:
            th.join(timeout=10)
        engine.broker.close()
    return engine


def _honest_rounds(engine: Engine, rounds: int, online: int) -> None:
    """Every round ran, saw every honest client online, and folded every client it selected."""
    rows = engine.runlog.rows()
    assert [r.round for r in rows] == list(range(1, rounds + 1))
    for row in rows:
        assert not row.skipped, (row.round, row.skip_reason)
        # round 1 may start before the one-client agents join (the host alone is the population)
        assert row.online_count == online or row.round == 1, (row.round, row.online_count)
        m = engine.cfg.selected_count()
        assert len(row.selected) == m and row.received == row.selected, (row.round, row.received)
    dropped = dict(engine.inbox.dropped)
    assert not {"stale-round", "not-selected", "no-open-round"} & set(dropped), dropped


def test_a_presence_flood_from_one_host_stalls_nobody_and_names_the_flooder(creds, job_id, tiny_lm, tmp_path):
    cfg = _cfg(job_id, 6, POPULATION, fraction=1 / 1000)
    # the host's own beat, leaving: no client of it is ever online, yet each one makes the engine look again
    body = messages.encode(messages.host_presence(job_id, "h0", "offline", [(0, 1)]))
    flood = Flood(creds["hosts"]["h0"]["url"], job_id, body)
    statuses: list[dict] = []

    def on_round(engine: Engine, row: dict) -> None:
        if row["round"] == 1:  # the flood starts while the engine is busy (as evaluating a round)
            flood.start()
            time.sleep(BUSY_S)
        else:
            statuses.append(engine.status())

    with capture_logs() as logs:
        engine = _run(creds, cfg, tiny_lm(POPULATION), tmp_path, on_round, host=True)
    sent = flood.sent()
    rows = engine.runlog.rows()
    assert sent >= 2_000  # a flood: far more than the honest beats
    _honest_rounds(engine, 6, POPULATION + len(HONEST))
    flooder = t.host_user(job_id, "h0")
    named = [e for e in logs if e.get("sender") == flooder and "presence" in e["event"]]
    windows = (rows[-1].time - rows[0].time) / cfg.presence_window_s
    assert 1 <= len(named) <= windows + 2, named
    assert engine.inbox.dropped["presence-over-budget"] > 0
    assert any(flooder in s["presence_over_budget"] for s in statuses)


def test_a_host_presence_for_a_client_outside_its_roster_is_refused(creds, job_id, tiny_lm, tmp_path):
    cfg = _cfg(job_id, 2, len(HONEST), fraction=1.0)
    host = connect(creds["hosts"]["h0"]["url"])
    stop = threading.Event()

    def say_phantom() -> None:  # h0's user says client h0-5000 (of a population of 2) is online
        env = messages.presence(job_id, "h0-5000", "online", messages.NO_VERSION)
        host.publish(t.rk_presence(job_id, "h0"), messages.encode(env), message_id=env.msg_id)

    def phantom() -> None:  # every beat
        while not stop.is_set():
            try:
                say_phantom()
            except BrokerError:  # the engine has not declared the job's exchange yet
                pass
            stop.wait(0.25)

    def after(engine: Engine, row: dict) -> None:
        """Once round 1 closed the exchange exists: one more phantom presence is queued (confirmed) before
        round 2's selection reads the queued presence, so the refusal is counted however fast the job runs."""
        if row["round"] == 1:
            say_phantom()

    beat = threading.Thread(target=phantom, daemon=True)
    beat.start()
    try:
        engine = _run(creds, cfg, tiny_lm(len(HONEST)), tmp_path, after, host=False)
    finally:
        stop.set()
        beat.join(timeout=5)
        host.close()
    _honest_rounds(engine, 2, len(HONEST))
    for row in engine.runlog.rows():
        assert "h0-5000" not in row.online and row.selected == HONEST
    assert engine.inbox.dropped["client-outside-roster"] >= 1
    assert "h0-5000" not in engine.online()
