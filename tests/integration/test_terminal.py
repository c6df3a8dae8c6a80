"""What a person sees: `fedmq simulate` in a real 24x80 pseudo-terminal (pexpect), a tiny two-round run."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pexpect
import pytest
from rich.cells import cell_len

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


@pytest.mark.slow
def test_simulate_at_an_80_column_terminal(tmp_path):
    # as a user runs it: from their own folder, into the default run folder runs/TIME-STRATEGY
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("COLUMNS", None), env.pop("LINES", None)
    child = pexpect.spawn(
        sys.executable,
        [
            "-m",
            "fedmq.cli.app",
            "simulate",
            "--rounds",
            "2",
            "--clients",
            "2",
            "--max-lines",
            "300",
            "--vocab-size",
            "500",
            "--max-steps",
            "3",
            "--bptt",
            "20",
            "--max-eval-lines",
            "50",
        ],
        cwd=str(tmp_path),
        env=env,
        dimensions=(24, 80),
        encoding="utf-8",
        timeout=240,
    )
    screen = child.read()
    child.close()
    assert child.exitstatus == 0, screen[-2000:]
    # every line as drawn: escape sequences removed, split where the cursor returns or moves down
    lines = [line for line in re.split(r"\r\n|\r|\n", ANSI.sub("", screen)) if line.strip()]
    too_wide = [line for line in lines if cell_len(line) > 80]
    assert not too_wide, too_wide
    assert "Traceback" not in screen and not any(
        line.lstrip().startswith("{") for line in lines
    )  # no JSON logs
    progress = [line for line in lines if line.startswith("rounds ━")]
    assert progress and re.search(r"2/2 .*perplexity \d+\.\d\d", progress[-1]), progress[-3:]
    score = next(line for line in lines if line.startswith("best valid perplexity"))
    assert re.search(r"best valid perplexity \d+\.\d\d \(round \d\) · test perplexity \d+\.\d\d", score), (
        score
    )
    (run,) = (tmp_path / "runs").iterdir()
    assert f"run folder: runs/{run.name}" in lines and f"plots:      fedmq report runs/{run.name}" in lines
    assert run.name.endswith("-fedavg") and (run / "summary.json").is_file()
    # the terminal shows warnings only; the run's log file keeps every event at the run's --log-level (info)
    events = [
        json.loads(line)["event"] for line in (run / "logs" / "simulate.jsonl").read_text().splitlines()
    ]
    assert "round closed" in events and "round announced" in events, events[:20]
