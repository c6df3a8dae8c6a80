"""`fedmq aggregator run` and `fedmq agent run` as separate processes over RabbitMQ, with metrics and status."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

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


def fedmq(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.app", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolved(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(fedmq("aggregator", "run", "--broker", "amqp://127.0.0.1", "--job", "j1",
                                "--config", str(tmp_path / "job.toml"), "--print-config", *args),
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ, **(env or {})})


def test_config_precedence_flags_env_file(tmp_path):
    (tmp_path / "job.toml").write_text(JOB_TOML)
    assert json.loads(resolved(tmp_path).stdout)["rounds"] == 2  # file
    assert json.loads(resolved(tmp_path, env={"FEDMQ_ROUNDS": "3"}).stdout)["rounds"] == 3  # env beats file
    out = resolved(tmp_path, "--rounds", "4", env={"FEDMQ_ROUNDS": "3"}).stdout
    assert json.loads(out)["rounds"] == 4  # flag beats env
    (tmp_path / "job.toml").write_text(JOB_TOML.replace("rounds = 2", "rounds = 0"))
    bad = resolved(tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: rounds must be at least 1"
    (tmp_path / "job.toml").write_text("rounds = [")
    bad = resolved(tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "not valid TOML" in bad.stderr


@pytest.mark.rabbitmq
def test_aggregator_and_agents_as_services(tmp_path, rabbit_url, job_id):
    (tmp_path / "job.toml").write_text(JOB_TOML)
    state = tmp_path / "state"
    port = free_port()
    common = ["--broker", rabbit_url, "--job", job_id, "--config", str(tmp_path / "job.toml")]
    agg = subprocess.Popen(fedmq("aggregator", "run", *common, "--state-dir", str(state), "--metrics-port", str(port)),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    agents = [subprocess.Popen(fedmq("agent", "run", *common, "--client-id", f"agent-{i}", "--device", "cpu"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
              for i in range(2)]
    try:
        metrics = ""
        deadline = time.time() + 120
        while time.time() < deadline and 'fedmq_rounds_total{outcome="completed"} 1.0' not in metrics:
            time.sleep(0.5)
            try:
                metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                continue
        assert 'fedmq_rounds_total{outcome="completed"} 1.0' in metrics
        assert re.search(r'fedmq_queue_depth\{queue="fedmq\.%s\.inbox"\} \d' % job_id, metrics)
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5).status == 200
        status = subprocess.run(fedmq("status", "--broker", rabbit_url, "--job", job_id, "--run-dir", str(state),
                                      "--json"), capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert status.returncode == 0, status.stderr
        info = json.loads(status.stdout)
        assert info["round"] >= 1 and f"fedmq.{job_id}.inbox" in info["queue_depths"]
        out, err = agg.communicate(timeout=180)
        assert agg.returncode == 0, err[-3000:]
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["rounds_completed"] == 2 and summary["rejected"] == {}
    finally:
        for p in [agg, *agents]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in agents:
            p.wait(timeout=30)
            assert p.returncode == 0, p.stderr.read()[-2000:]
        if agg.poll() is None:
            agg.kill()
