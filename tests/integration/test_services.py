"""`fedmq aggregator run` and `fedmq agent run` as separate processes over RabbitMQ,
with metrics and status."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import fedmq_procs
import pika
import pytest
from load_factor import budget

from fedmq.broker.transport import topology as t
from fedmq.cli.status_info import gather

ROOT = Path(__file__).resolve().parents[2]
JOB_TOML = """
rounds = 2
clients = 2
fraction = 1.0
heartbeat_s = 1.0
join_timeout_s = 60.0
max_steps = 5
lr = 10.0
identity = "shared:guest"

[task]
task = "lm"
data = "builtin"
model = "gru-tiny"
max_lines = 800
vocab_size = 1500
max_eval_lines = 100
"""


fedmq = fedmq_procs.command  # the command line of `fedmq ARGS`


def resolved(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return fedmq_procs.run(
        fedmq(
            "aggregator",
            "run",
            "--broker",
            "amqp://127.0.0.1",
            "--job",
            "j1",
            "--config",
            str(tmp_path / "job.toml"),
            "--print-config",
            *args,
        ),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def test_config_precedence_flags_env_file(tmp_path):
    (tmp_path / "job.toml").write_text(JOB_TOML)
    assert json.loads(resolved(tmp_path).stdout)["rounds"] == 2  # file
    assert json.loads(resolved(tmp_path, env={"FEDMQ_ROUNDS": "3"}).stdout)["rounds"] == 3  # env beats file
    out = resolved(tmp_path, "--rounds", "4", env={"FEDMQ_ROUNDS": "3"}).stdout
    assert json.loads(out)["rounds"] == 4  # flag beats env
    (tmp_path / "job.toml").write_text(JOB_TOML.replace("rounds = 2", "rounds = 0"))
    bad = resolved(tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: rounds (--rounds) must be at least 1"
    (tmp_path / "job.toml").write_text("rounds = [")
    bad = resolved(tmp_path)
    assert (
        bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "not valid TOML" in bad.stderr
    )


def _presences(url: str, job: str, client: str, stop: threading.Event) -> tuple[list[float], list[str]]:
    """When ``client``'s presence messages pass through the job's exchange, and what went wrong watching:
    a thread (with a connection of its own) waits for the aggregator to declare the exchange, then records
    them until ``stop``. Returns once it watches."""
    seen: list[float] = []
    errors: list[str] = []
    watching = threading.Event()

    def watch() -> None:
        try:
            conn = pika.BlockingConnection(pika.URLParameters(url))
            ch, deadline = conn.channel(), time.monotonic() + budget(60)
            while True:
                try:
                    ch.exchange_declare(t.exchange(job), passive=True)
                    break
                except pika.exceptions.ChannelClosedByBroker:
                    if time.monotonic() > deadline:
                        raise AssertionError("the aggregator did not declare the job's exchange") from None
                    ch = conn.channel()
                    time.sleep(0.1)
            queue = ch.queue_declare("", exclusive=True).method.queue
            ch.queue_bind(queue, t.exchange(job), t.rk_presence(job, client))
            watching.set()
            while not stop.is_set():
                method, _, _ = ch.basic_get(queue, auto_ack=True)
                if method is None:
                    conn.sleep(0.05)
                else:
                    seen.append(time.monotonic())
            conn.close()
        except Exception as exc:
            errors.append(repr(exc))
        finally:
            watching.set()

    threading.Thread(target=watch, daemon=True).start()
    watching.wait(budget(70))
    return seen, errors


@pytest.mark.rabbitmq
def test_aggregator_and_agents_as_services(tmp_path, rabbit_url, job_id, free_port):
    (tmp_path / "job.toml").write_text(JOB_TOML)
    state = tmp_path / "state"
    port = free_port
    common = ["--broker", rabbit_url, "--job", job_id, "--config", str(tmp_path / "job.toml")]
    agg = fedmq_procs.popen(
        fedmq(
            "aggregator",
            "run",
            *common,
            "--rounds",
            "3",
            "--state-dir",
            str(state),
            "--metrics-port",
            str(port),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    stop_watching = threading.Event()
    try:
        beats, watch_errors = _presences(rabbit_url, job_id, "agent-0", stop_watching)
        assert not watch_errors, (watch_errors, agg.poll())
    except BaseException:
        agg.kill()
        raise
    agents = [
        fedmq_procs.popen(
            # each round's training takes 1.5 s more (a fault the agent injects on purpose): the live status
            # below is read while a round is under way, however fast the machine
            fedmq(
                "agent",
                "run",
                *common,
                "--client-id",
                f"agent-{i}",
                "--device",
                "cpu",
                "--faults",
                "slow:1:1.5",
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for i in range(2)
    ]
    try:
        # live: the aggregator's own view (phase, agents online), not "—" and "agents online 0"
        live, deadline = {}, time.time() + budget(120)
        while time.time() < deadline and not (
            live.get("agents_online") == ["agent-0", "agent-1"]
            and live.get("phase") in ("training", "uploading")
        ):
            time.sleep(0.1)
            live = gather(rabbit_url, job_id, state) if (state / "status.json").is_file() else {}
        assert live.get("phase") in ("training", "uploading") and live["aggregators"] == 1, live
        assert live["agents_online"] == ["agent-0", "agent-1"], live
        metrics = ""
        deadline = time.time() + budget(120)
        completed = re.compile(r'fedmq_rounds_total\{outcome="completed"\} [12]\.0')
        while time.time() < deadline and not completed.search(metrics):
            time.sleep(0.5)
            try:
                metrics = (
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                )
            except OSError:
                continue
        assert completed.search(metrics), metrics
        assert re.search(rf'fedmq_queue_depth\{{queue="fedmq\.{job_id}\.inbox"\}} \d', metrics)
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5).status == 200
        status = fedmq_procs.run(
            fedmq("status", "--broker", rabbit_url, "--job", job_id, "--run-dir", str(state), "--json"),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert status.returncode == 0, status.stderr
        info = json.loads(status.stdout)
        assert info["round"] >= 1 and f"fedmq.{job_id}.inbox" in info["queue_depths"]
        out, err = agg.communicate(timeout=180)
        assert agg.returncode == 0, err[-3000:]
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["rounds_completed"] == 3 and summary["rejected"] == {}
        # the job is over: the agents are told so and leave by themselves, exit code 0
        for i, p in enumerate(agents):
            assert p.wait(timeout=budget(30)) == 0
            assert f"job {job_id} finished: agent agent-{i} left" in p.stderr.read()
        # an agent beats at the job file's heartbeat (1 s), not at a default of its own (5 s): no gap between
        # its presences reaches the aggregator's window of three heartbeats
        stop_watching.set()
        gaps = [round(b - a, 2) for a, b in zip(beats, beats[1:])]
        assert len(beats) >= 3 and max(gaps) < 3.0, (gaps, watch_errors)
        after = fedmq_procs.run(
            fedmq("status", "--broker", rabbit_url, "--job", job_id, "--run-dir", str(state), "--json"),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert after.returncode == 0, after.stderr
        done = json.loads(after.stdout)
        assert done["phase"] == "finished" and done["agents_online"] == [] and done["round"] == 3, (
            done
        )  # the last round
        unknown = fedmq_procs.run(
            fedmq("status", "--broker", rabbit_url, "--job", job_id + "x"),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert unknown.returncode == 1 and unknown.stdout == "", unknown
        assert unknown.stderr.count("\n") == 1 and f"no job '{job_id}x' in vhost '/' on" in unknown.stderr, (
            unknown.stderr
        )
    finally:
        stop_watching.set()
        for p in [agg, *agents]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in agents:
            p.wait(timeout=budget(30))
            assert p.returncode == 0, p.stderr.read()[-2000:]
        if agg.poll() is None:
            agg.kill()


@pytest.mark.rabbitmq
@pytest.mark.parametrize(
    "url, says",
    [
        ("amqp://guest:wrong-password@127.0.0.1:5672/%2F", "authentication refused for user 'guest'"),
        ("amqp://guest:guest@127.0.0.1:5672/no-such-vhost", "access to virtual host 'no-such-vhost' refused"),
        ("amqp://guest:guest@127.0.0.1:notaport/%2F", "bad broker URL"),
    ],
)
def test_an_agent_gives_up_on_permanent_broker_errors_in_one_line(tmp_path, rabbit_url, job_id, url, says):
    """Refused credentials, a missing virtual host or a malformed URL: retrying cannot help, so the agent says
    so once and exits instead of retrying every 10 s forever."""
    (tmp_path / "job.toml").write_text(JOB_TOML)
    proc = fedmq_procs.run(
        fedmq(
            "agent",
            "run",
            "--broker",
            url,
            "--job",
            job_id,
            "--config",
            str(tmp_path / "job.toml"),
            "--client-id",
            "agent-0",
            "--device",
            "cpu",
        ),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and says in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "retrying" not in proc.stderr
