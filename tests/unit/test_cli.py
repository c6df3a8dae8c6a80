"""The fedmq CLI: help on every command, and every documented user error is one line, exit code 2, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def fedmq(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.app", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


@pytest.mark.parametrize("cmd", [[], ["simulate"], ["aggregator", "run"], ["agent", "run"], ["broker", "provision"],
                                 ["broker", "check"], ["broker", "purge"], ["status"], ["report"], ["bench", "codec"],
                                 ["bench", "broker"], ["bench", "aggregate"], ["bench", "train"], ["bench", "load"], ["bench", "flower"],
                                 ["experiment"]])
def test_help_everywhere(cmd):
    proc = fedmq(*cmd, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Usage" in proc.stdout
    if cmd:
        assert "Example" in proc.stdout


@pytest.mark.parametrize("args,needle", [
    (["simulate", "--strategy", "fedfoo"], "unknown strategy"),
    (["simulate", "--data", "/nonexistent/corpus"], "/nonexistent/corpus"),
    (["simulate", "--broker", "nats://x"], "unsupported broker URL scheme"),
    (["simulate", "--broker", "amqp://guest:guest@127.0.0.1:1/%2F", "--rounds", "1"], "127.0.0.1"),
    (["simulate", "--encoding", "zip9"], "encoding"),
    (["simulate", "--availability", "sometimes"], "availability"),
    (["simulate", "--fraction", "2"], "fraction"),
    (["simulate", "--log-level", "loud"], "log level"),
    (["simulate", "--robust", "clip:-1"], "robust"),
    (["simulate", "--down-encoding", "int9"], "encoding"),
    (["report", "/nonexistent/run"], "/nonexistent/run"),
    (["bench", "flower", "--data", "/nonexistent/corpus"], "/nonexistent/corpus"),
    (["bench", "flower", "--data", ".", "-k", "5", "--selected", "10"], "--selected"),
    (["bench", "flower", "--data", ".", "--scale", "ten"], "--scale"),
    (["broker", "check", "--broker", "amqp://guest:guest@127.0.0.1:1/%2F"], "cannot connect"),
    (["status", "--job", "j", "--broker", "amqp://guest:guest@127.0.0.1:1/%2F"], "cannot connect"),
    (["agent", "run", "--broker", "amqp://127.0.0.1:1/", "--job", "j"], "--client-id"),
    (["agent", "run", "--broker", "amqp://127.0.0.1:1/", "--job", "j", "--client-id", "agent-0",
      "--availability", "markov:2,1"], "markov"),
    (["aggregator", "run", "--broker", "amqp://127.0.0.1:1/", "--config", "/nonexistent/job.toml"], "not found"),
    (["aggregator", "run", "--broker", "amqp://127.0.0.1:1/", "--strategy", "fedfoo", "--print-config"], "unknown strategy"),
])
def test_user_errors_are_one_line(args, needle, tmp_path):
    proc = fedmq(*args, "--out", str(tmp_path / "run")) if args[0] == "simulate" else fedmq(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert needle.lower() in err.lower()
