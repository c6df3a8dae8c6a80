"""`fedmq simulate` with no options trains smoothly: after the first round its validation perplexity never
rises by more than 2 % (fedmq/defaults.py says why its defaults are what they are, with the sweep behind
them)."""

from __future__ import annotations

import json
from pathlib import Path

import fedmq_procs

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_run_falls_every_round(tmp_path):
    out = tmp_path / "run"
    done = fedmq_procs.run(
        # the default run's first 5 of its 8 rounds (the same rounds: nothing in them depends on the total)
        fedmq_procs.command("simulate", "--rounds", "5", "--out", str(out), "--json"),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    valid = [json.loads(line)["valid"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(valid) == 5
    rises = [later / earlier - 1 for earlier, later in zip(valid[1:], valid[2:])]
    assert max(rises) <= 0.02, valid
    assert valid[-1] < valid[0] / 1.5, valid
