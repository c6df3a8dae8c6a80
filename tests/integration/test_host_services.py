"""Hosts over the real RabbitMQ: a provisioned host user speaks for its own clients only, and `fedmq agent run
--host` processes (one named with --clients, one from a StatefulSet pod's hostname) run a job with the
aggregator service; SIGTERM makes a host leave the job at once, offline for all its clients."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import fedmq_procs
import pika
import pika.exceptions as pe
import pytest
from load_factor import budget

from fedmq.broker.transport import provision as prov
from fedmq.broker.transport import topology as t
from fedmq.broker.transport.admin import CtlAdmin, local_ctl
from fedmq.broker.transport.connect import connect
from fedmq.broker.transport.errors import BrokerError

pytestmark = pytest.mark.rabbitmq
ROOT = Path(__file__).resolve().parents[2]
JOB_TOML = """
rounds = {rounds}
clients = 8
fraction = 0.5
heartbeat_s = {heartbeat}
join_timeout_s = 60.0
max_steps = 3
batch_size = 4
lr = 5.0
identity = "shared:guest"

[task]
task = "lm"
data = "builtin"
model = "gru-small"
emb = 16
hidden = 16
vocab_size = 500
max_lines = 600
max_eval_lines = 100
bptt = 10
"""
# `fedmq` in a pod of a StatefulSet: the hostname is the pod's name
AS_POD = (
    "import socket, sys; pod = sys.argv.pop(1); socket.gethostname = lambda: pod; sys.argv[0] = 'fedmq'; "
    "from fedmq.cli.app import main; main()"
)


def test_a_host_user_speaks_for_its_own_clients_only(rabbit_url, job_id):
    vhost = f"fedmqt-{uuid.uuid4().hex[:8]}"
    admin = CtlAdmin()
    creds = prov.provision(rabbit_url, vhost=vhost, job=job_id, agents=[], hosts=["h1"], admin=admin)
    try:
        assert "name: fedmq-host-h1" in prov.secret_manifests(creds)
        with connect(creds["aggregator"]["url"]) as agg, connect(creds["hosts"]["h1"]["url"]) as host:
            assert host.user == t.host_user(job_id, "h1") == f"{job_id}.host.h1"
            agg.declare_job(job_id, [], model_bytes=1000)
            host.declare_job(job_id, ["h1"], inbox=False)  # its own queues, bound to its announce and grant
            agg.publish(t.rk_model(job_id), b"model v0", message_id="m0")
            assert host.fetch(t.q_models(job_id), "m0", offset="first", timeout=10).body == b"model v0"

            mine = [
                t.rk_presence(job_id, "h1"),
                t.rk_report(job_id, "h1-0"),
                t.rk_update(job_id, "h1-2499"),
                t.rk_presence(job_id, "h1-7"),
            ]
            got: list = []
            done = threading.Event()

            def take(d) -> None:
                got.append((d.routing_key, d.user_id))
                agg.ack(d)
                if len(got) == len(mine):
                    done.set()

            agg.consume(t.q_inbox(job_id), take)
            for key in mine:
                host.publish(key, b"mine", message_id=key)
            assert done.wait(budget(10))
            assert sorted(got) == sorted((key, t.host_user(job_id, "h1")) for key in mine)

            forged = [
                t.rk_report(job_id, "h2-0"),  # another host's client
                t.rk_update(job_id, "agent-0"),  # a one-client agent
                t.rk_report(job_id, "h10-0"),  # a host whose id starts with ours
                t.rk_report(job_id, "h1-01"),  # not a client number's spelling
                t.rk_report(job_id, "h1"),  # the host itself reports nothing
                t.rk_presence(job_id, "h2"),
                t.rk_model(job_id),
                t.rk_announce(job_id, "h1"),
                t.rk_dead(job_id),
            ]
            for key in forged:
                with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
                    host.publish(key, b"forged")
            with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
                host.consume(t.q_inbox(job_id), lambda d: None)
            with pytest.raises(BrokerError, match="403|ACCESS_REFUSED"):
                host.declare_job(job_id, ["h2"], inbox=False)

            heard: list = []
            host.consume(t.q_latest(job_id, "h1"), lambda d: (heard.append(d.body), host.ack(d)))
            agg.publish(t.rk_announce(job_id, "h1"), b"announce")
            deadline = time.time() + budget(10)
            while not heard and time.time() < deadline:
                time.sleep(0.05)
            assert heard == [b"announce"] and host.status()["reconnects"] == 0

        # nor may the host bind its queue to another host's announcements (to eavesdrop)
        conn = pika.BlockingConnection(pika.URLParameters(creds["hosts"]["h1"]["url"]))
        try:
            with pytest.raises(pe.ChannelClosedByBroker) as exc:
                conn.channel().queue_bind(
                    t.q_latest(job_id, "h1"), t.exchange(job_id), routing_key=t.rk_announce(job_id, "h2")
                )
            assert exc.value.reply_code == 403
        finally:
            conn.close()
    finally:  # (deleting the vhost deletes its queues)
        admin.delete_users([t.aggregator_user(job_id), t.host_user(job_id, "h1")])
        admin.delete_vhost(vhost)


def _start(
    tmp_path: Path, rabbit_url: str, job_id: str, *args: str, rounds: int, heartbeat: float = 1.0
) -> tuple[list[str], subprocess.Popen]:
    (tmp_path / "job.toml").write_text(JOB_TOML.format(rounds=rounds, heartbeat=heartbeat))
    common = ["--broker", rabbit_url, "--job", job_id, "--config", str(tmp_path / "job.toml")]
    agg = fedmq_procs.popen(
        fedmq_procs.command(
            "aggregator",
            "run",
            *common,
            "--state-dir",
            str(tmp_path / "s"),
        )
        + list(args),
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "aggregator.log").open("w"),  # (a pipe nobody reads would fill up and block it)
        text=True,
        cwd=ROOT,
    )
    return common, agg


def _host(*args: str, pod: str | None = None) -> subprocess.Popen:
    run = [sys.executable, "-c", AS_POD, pod] if pod else fedmq_procs.command()
    return fedmq_procs.popen(
        [*run, "agent", "run", *args, "--device", "cpu", "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=budget(30))


def test_two_host_processes_run_a_job_with_the_aggregator(tmp_path, rabbit_url, job_id):
    common, agg = _start(tmp_path, rabbit_url, job_id, rounds=2)
    hosts = [
        _host(*common, "--host", "h0", "--clients", "0-3", "--audit-log", str(tmp_path / "audit.jsonl")),
        # pod 1 of 2: host h1, the second half of the 8 clients
        _host(*common, "--host-from-hostname", "--hosts", "2", pod="fedmq-agent-1"),
    ]
    try:
        out, _ = agg.communicate(timeout=120)
        assert agg.returncode == 0, (tmp_path / "aggregator.log").read_text()[-3000:]
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["rounds_completed"] == 2 and summary["rejected"] == {}, summary
        for i, p in enumerate(hosts):
            assert p.wait(timeout=budget(30)) == 0
            assert f"job {job_id} finished: host h{i} left (4 clients)" in p.stderr.read()
        rows = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [1, 2]
        served = {f"h0-{n}" for n in range(4)} | {f"h1-{n}" for n in range(4, 8)}
        for r in rows:  # 4 of the 8 clients each round, each trained by its host and folded
            assert len(r["selected"]) == 4 and set(r["selected"]) <= served, r
            assert sorted(r["received"]) == sorted(r["selected"]), r
        # h0's audit log: one line per confirmed upload of its clients, the ids the rounds folded
        audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
        folded = {
            (r["round"], c, r["update_ids"][c]) for r in rows for c in r["received"] if c.startswith("h0-")
        }
        assert folded and {(a["round"], a["client"], a["update_id"]) for a in audit} == folded
        ctl = local_ctl(rabbit_url)
        assert ctl is not None
        queues = ctl.queues("/", f"fedmq.{job_id}.")
        assert len(queues) == 3 + 2 * 2, queues  # inbox, dead letters, model stream; two per host
        assert {t.q_latest(job_id, "h1"), t.q_control(job_id, "h1")} <= set(queues)
        purged = fedmq_procs.run(
            fedmq_procs.command("broker", "purge", "--job", job_id, "--hosts", "2"),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert purged.returncode == 0 and ctl.queues("/", f"fedmq.{job_id}.") == [], purged.stderr
    finally:
        _stop(agg, *hosts)
        prov.purge(rabbit_url, job_id, ["h0", "h1"])


def _get(port: int, path: str) -> str:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).read().decode()
    except OSError:
        return ""


def _gauge(text: str, name: str) -> float | None:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_sigterm_makes_a_host_leave_the_job_at_once(tmp_path, rabbit_url, job_id, free_port):
    """A heartbeat of 5 s: without the host's offline presence its clients would stay online for 15 s."""
    common, agg = _start(
        tmp_path, rabbit_url, job_id, "--metrics-port", str(free_port), rounds=200, heartbeat=5.0
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        host_port = s.getsockname()[1]
    host = _host(*common, "--host", "h0", "--clients", "0-7", "--metrics-port", str(host_port))
    try:
        deadline, trained = time.time() + budget(60), None
        while time.time() < deadline and not trained:
            time.sleep(0.3)
            trained = _gauge(_get(host_port, "/metrics"), "fedmq_rounds_trained")
        assert trained and _get(host_port, "/readyz"), "the host trained no client's round"
        assert _gauge(_get(free_port, "/metrics"), "fedmq_agents_online") == 8
        host.send_signal(signal.SIGTERM)
        assert host.wait(timeout=budget(20)) == 0
        assert "SIGTERM: leaving the job" in host.stderr.read()
        deadline, online = time.time() + 4, None
        while time.time() < deadline and online != 0:
            time.sleep(0.1)
            online = _gauge(_get(free_port, "/metrics"), "fedmq_agents_online")
        assert online == 0, "no offline presence from the host: its clients stay online for 3 heartbeats"
    finally:
        agg.send_signal(signal.SIGTERM)
        try:
            agg.wait(timeout=budget(30))
        finally:
            _stop(agg, host)
            prov.purge(rabbit_url, job_id, ["h0"])
