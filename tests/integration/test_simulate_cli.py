"""`fedmq simulate` end to end: the run folder, learning, Ctrl-C + --resume, and the same over RabbitMQ."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--clients", "4", "--fraction", "0.5", "--model", "gru-tiny", "--max-lines", "1500", "--vocab-size", "2000",
        "--max-steps", "15", "--bptt", "20", "--lr", "10"]


def fedmq(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.app", *args]


def rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_simulate_writes_the_run_folder_and_learns(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(fedmq("simulate", *TINY, "--rounds", "3", "--out", str(run)), capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])  # not a TTY: machine-readable summary
    assert summary["rounds_completed"] == 3 and summary["test"] > 1
    for name in ("config.json", "metrics.jsonl", "summary.json", "best.pt", "logs/simulate.jsonl"):
        assert (run / name).is_file(), name
    assert list((run / "checkpoints").glob("*.fmq"))
    config = json.loads((run / "config.json").read_text())
    assert config["strategy"] == "fedavg" and config["clients"] == 4
    scores = [r["valid"] for r in rows(run)]
    assert len(scores) == 3 and scores[-1] < scores[0]  # validation perplexity falls over the rounds
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in rows(run))


def test_ctrl_c_checkpoints_and_resume_continues(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(fedmq("simulate", *TINY, "--rounds", "5", "--out", str(run)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.time() + 240
    while len(rows(run)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert len(rows(run)) >= 2, "two rounds did not finish in time"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["interrupted"] is True
    done = len(rows(run))
    assert 2 <= done < 5
    proc = subprocess.run(fedmq("simulate", *TINY, "--rounds", "5", "--out", str(run), "--resume"),
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["round"] for r in rows(run)] == [1, 2, 3, 4, 5]  # no round lost, none run twice
    assert [r["version"] for r in rows(run)] == [1, 2, 3, 4, 5]


def test_resume_without_a_run_folder_is_one_line(tmp_path):
    proc = subprocess.run(fedmq("simulate", "--out", str(tmp_path / "none"), "--resume"), capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--resume" in proc.stderr


@pytest.mark.rabbitmq
def test_simulate_over_rabbitmq(tmp_path, rabbit_url):
    run = tmp_path / "run"
    proc = subprocess.run(fedmq("simulate", *TINY, "--rounds", "2", "--out", str(run), "--broker", rabbit_url),
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rounds_completed"] == 2 and summary["rejected"] == {}
    assert json.loads((run / "config.json").read_text())["identity"] == "shared:guest"
