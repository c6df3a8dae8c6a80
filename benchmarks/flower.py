"""`fedmq bench flower`: fedmq and Flower 1.41 on the same task, in one command, on the same machine.

The task is the FedAtt paper's setting made all-framework: GRU-small with tied embeddings over a corpus's full
vocabulary (WikiText-2: 33,278 words), K clients of which C·K train per round, one local step of batch 2 ×
BPTT 8, validation on one line, R rounds. Each system runs as its own process, one after the other:

* Flower: benchmarks/flower_app.py in the venv that has ``flwr[simulation]==1.41.0`` (FedAvg, Ray simulation).
* fedmq: ``fedmq simulate`` on the in-process broker: default encodings (delta+bf16 up, bf16 down), raw both
  ways (lossless), and the recommended compressed ones.
* the scaling curve: fedmq at K ∈ ``scale`` with ``selected`` clients per round.

Reported per run: s/round (median of rounds 2..R), wire bytes/round (median; parameters sent to and received
from the training clients: Flower's serialized ``Parameters``, fedmq's metrics.jsonl
``bytes_up + bytes_down``, which counts each model message once per client that reads it, and the
announcements to every agent), and peak memory: the summed RSS of the run's whole process tree (Ray's raylet,
GCS and workers included), sampled every 0.2 s, which over-counts pages shared between processes; and the rise
of the machine's used memory over what it was before the run, which does not
(but sees everything else on the machine).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from fedmq.aggregator.runlog import read_rounds

REPO = Path(__file__).resolve().parents[1]
DEFAULT_FLOWER_PYTHON = REPO / ".fedmq-cache" / "flower-venv" / "bin" / "python"
RECOMMENDED = (
    "delta+int4-row",
    "int4-row",
)  # uplink, downlink: within 2 % of raw on PTB (docs/benchmarks.md)


@dataclass
class Run:
    name: str
    s_per_round: float | None = None
    bytes_per_round: float | None = None
    peak_tree_gb: float = 0.0
    peak_used_gb: float = 0.0
    rounds: int = 0
    note: str = ""
    raw: list[dict] = field(default_factory=list)


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def _measured(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str, int, int]:
    """Run ``cmd``; returns (exit code, stdout, stderr, peak tree RSS, peak rise of used memory)."""
    base = psutil.virtual_memory().used
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=REPO)
        ps = psutil.Process(proc.pid)
        peak_tree = peak_used = 0
        deadline = time.time() + timeout
        while proc.poll() is None:
            peak_tree = max(peak_tree, _tree_rss(ps))
            peak_used = max(peak_used, psutil.virtual_memory().used - base)
            if time.time() > deadline:
                for child in ps.children(recursive=True):
                    child.kill()
                proc.kill()
                break
            time.sleep(0.2)
        proc.wait()
        out.seek(0)
        err.seek(0)
        return (
            proc.returncode,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
            peak_tree,
            peak_used,
        )


def _median_rows(rows: list[dict]) -> tuple[float | None, float | None]:
    later = rows[1:] or rows
    if not later:
        return None, None
    return (
        statistics.median(r["wall_s"] for r in later),
        statistics.median(r["bytes_up"] + r["bytes_down"] for r in later),
    )


def run_fedmq(
    name: str,
    data: str,
    clients: int,
    selected: int,
    rounds: int,
    encoding: str = "delta+bf16",
    down_encoding: str = "bf16",
    timeout: float = 1800,
) -> Run:
    with tempfile.TemporaryDirectory(prefix="fedmq-bench-") as tmp:
        out = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            "fedmq.cli.app",
            "simulate",
            "--data",
            data,
            "--model",
            "gru-small",
            "--tied",
            "-k",
            str(clients),
            "-c",
            repr(selected / clients),
            "--max-steps",
            "1",
            "-b",
            "2",
            "--bptt",
            "8",
            "-r",
            str(rounds),
            "--max-eval-lines",
            "1",
            "--encoding",
            encoding,
            "--down-encoding",
            down_encoding,
            "--out",
            str(out),
            "--log-level",
            "warning",
        ]
        code, _, err, tree, used = _measured(cmd, dict(os.environ), timeout)
        rows = [r.to_json() for r in read_rounds(out).records]  # dicts, as Flower's rows are
    run = Run(name, peak_tree_gb=tree / 1e9, peak_used_gb=used / 1e9, rounds=len(rows), raw=rows)
    run.s_per_round, run.bytes_per_round = _median_rows([r for r in rows if not r.get("skipped")])
    if code != 0 or len(rows) < rounds:
        run.note = f"exit {code}: {err.strip().splitlines()[-1] if err.strip() else 'no output'}"
    return run


def run_flower(
    python: Path, data: str, clients: int, selected: int, rounds: int, timeout: float = 1800
) -> Run:
    if not Path(python).is_file():
        return Run(
            "flower 1.41",
            note=f"no Flower venv at {python}: see docs/benchmarks.md (pip install -e '.[bench]')",
        )
    task = {
        "task": "lm",
        "data": data,
        "model": "gru-small",
        "tied": True,
        "clients": clients,
        "bptt": 8,
        "max_eval_lines": 1,
    }
    train = {"epochs": 1, "batch_size": 2, "lr": 20.0, "clip": 0.25, "max_steps": 1}
    cmd = [
        str(python),
        "-m",
        "fedmq.benchmarks.flower_app",
        "--task",
        json.dumps(task),
        "--train",
        json.dumps(train),
        "--clients",
        str(clients),
        "--fraction",
        repr(selected / clients),
        "--rounds",
        str(rounds),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    code, out, err, tree, used = _measured(cmd, env, timeout)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"round"')]
    run = Run("flower 1.41", peak_tree_gb=tree / 1e9, peak_used_gb=used / 1e9, rounds=len(rows), raw=rows)
    run.s_per_round, run.bytes_per_round = _median_rows(rows)
    if code != 0 or len(rows) < rounds:
        run.note = f"exit {code}: {err.strip().splitlines()[-1] if err.strip() else 'no output'}"
    return run


def bench_flower(
    data: str,
    clients: int = 100,
    selected: int = 10,
    rounds: int = 5,
    scale: tuple[int, ...] = (),
    flower_python: Path = DEFAULT_FLOWER_PYTHON,
    flower: bool = True,
) -> list[Run]:
    runs = []
    if flower:
        runs.append(run_flower(flower_python, data, clients, selected, rounds))
    runs.append(run_fedmq(f"fedmq K={clients}", data, clients, selected, rounds))
    runs.append(run_fedmq(f"fedmq K={clients} raw/raw", data, clients, selected, rounds, "raw", "raw"))
    runs.append(
        run_fedmq(
            f"fedmq K={clients} {RECOMMENDED[0]}/{RECOMMENDED[1]}",
            data,
            clients,
            selected,
            rounds,
            *RECOMMENDED,
        )
    )
    for k in scale:
        if k != clients:
            runs.append(run_fedmq(f"fedmq K={k}", data, k, selected, rounds))
    return runs


def format_table(runs: list[Run]) -> str:
    anchor = next((r for r in runs if r.name.startswith("flower") and r.s_per_round), None)

    def ratio(value: float | None, ref: float | None) -> str:
        return f"{value / ref:.2f}" if value and ref else "—"

    lines = [
        "| run | s/round | × Flower | MB/round | × Flower | peak tree RSS GB | × Flower "
        "| peak used-memory rise GB | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r.name} | {r.s_per_round or float('nan'):.2f} "
            f"| {ratio(r.s_per_round, anchor and anchor.s_per_round)} "
            f"| {(r.bytes_per_round or 0) / 1e6:.1f} "
            f"| {ratio(r.bytes_per_round, anchor and anchor.bytes_per_round)} "
            f"| {r.peak_tree_gb:.2f} | {ratio(r.peak_tree_gb, anchor and anchor.peak_tree_gb)} "
            f"| {r.peak_used_gb:.2f} | {r.note} |"
        )
    return "\n".join(lines)
