"""The same seed and config give the same numbers bit for bit, whatever the broker, the arrival order and the
number of clients that train at once."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

import fedmq_procs
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# every client trains and is folded each round, so the order in which four updates arrive is free to vary
JOB = [
    "--clients",
    "4",
    "--fraction",
    "1.0",
    "--model",
    "gru-tiny",
    "--max-lines",
    "800",
    "--vocab-size",
    "1000",
    "--max-steps",
    "6",
    "--bptt",
    "16",
    "--lr",
    "10",
    "--rounds",
    "3",
    "--seed",
    "7",
]


def _simulate(run: Path, *extra: str) -> tuple[list[dict], dict]:
    proc = fedmq_procs.run(
        fedmq_procs.command("simulate", *JOB, "--out", str(run), *extra),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads(proc.stdout.strip().splitlines()[-1])


def _numbers(rows: list[dict]) -> list[tuple]:
    return [(r["round"], r["valid"], r["mean_loss"], r["losses"], r["weights"], r["received"]) for r in rows]


@pytest.mark.rabbitmq
@pytest.mark.slow
def test_same_seed_same_numbers_in_process_slowed_and_over_rabbitmq(tmp_path, rabbit_url):
    plain_rows, plain = _simulate(tmp_path / "plain")
    # half the agents sleep before reporting: updates arrive in another order than in the plain run
    slow_rows, slow = _simulate(tmp_path / "slow", "--faults", "slow:0.5:0.7")
    rabbit_rows, rabbit = _simulate(tmp_path / "rabbit", "--broker", rabbit_url)
    # two clients train at once, each on a model of its own: which model a client trains on changes nothing
    two_rows, two = _simulate(tmp_path / "two", "--trainers", "2")
    assert len(plain_rows) == 3 and all(len(r["received"]) == 4 for r in plain_rows)
    assert _numbers(slow_rows) == _numbers(plain_rows)
    assert _numbers(rabbit_rows) == _numbers(plain_rows)
    assert _numbers(two_rows) == _numbers(plain_rows)
    assert slow["test"] == plain["test"] == rabbit["test"] == two["test"]
    final = [
        torch.load(tmp_path / name / "best.pt", weights_only=True)
        for name in ("plain", "slow", "rabbit", "two")
    ]
    for other in final[1:]:
        assert other.keys() == final[0].keys()
        assert all(torch.equal(other[k], final[0][k]) for k in final[0])


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch was built without Intel MKL")
def test_mkl_computes_in_its_reproducible_mode(tmp_path):
    """MKL's run-to-run reproducibility (MKL_CBWR) is on in every matrix product of a run: MKL_VERBOSE names
    the mode of each call."""
    proc = fedmq_procs.run(
        fedmq_procs.command("simulate", *JOB[:-4], "--rounds", "1", "--out", str(tmp_path / "run")),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        # the command sets the mode itself: none comes from the environment
        env={**{k: v for k, v in os.environ.items() if k != "MKL_CBWR"}, "MKL_VERBOSE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    modes = Counter(re.findall(r"CNR:(\S+)", proc.stdout))
    assert sum(modes.values()) > 100 and set(modes) == {"AUTO"}, modes
