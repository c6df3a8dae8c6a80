"""`fedmq bench flower`: fedmq and Flower 1.41 on the same task, in one command, on the same machine.

The task is the FedAtt paper's setting made all-framework: GRU-small with tied embeddings over a corpus's full
vocabulary (WikiText-2: 33,278 words), K clients of which C·K train per round, one local step of batch 2 ×
BPTT 8, validation on one line, R rounds. Each system runs as its own process, one after the other:

* Flower: benchmarks/flower_app.py (the Message API, written as a careful Flower user writes it: task and
  model built once per actor, only parameters in the messages, a tied matrix once) in the venv that has
  ``flwr[simulation]==1.41.0``; with ``control``, also benchmarks/flower_control.py, a minimal harness written
  apart from it on Flower's classic API, whose s/round the bench's Flower side must match (within ±20 %).
* fedmq: ``fedmq simulate`` on the in-process broker: default encodings (delta+bf16 up, bf16 down), raw both
  ways (lossless), and the recommended compressed ones. Its clients train as Flower's do: as many at once as
  there are usable cores, torch held to one thread each (``--trainers`` the cores, ``OMP_NUM_THREADS=1``; Ray
  gives each one-CPU actor one thread).
* the scaling curve: fedmq at K ∈ ``scale`` with ``selected`` clients per round.

s/round is the same interval on both sides: the period from one round's end to the next's, where a round ends
when its aggregate is made and validated (fedmq: the round's record, its ``time``; Flower: ``evaluate_fn``
returning), median over rounds 2..R. It holds everything a round costs, the checkpoint, the server's
validation and the next round's sampling included. Wire bytes/round (median): parameters sent to and received
from the training clients: Flower's serialized arrays, fedmq's metrics.jsonl ``bytes_up + bytes_down``, which
counts each model message once per client that reads it, and the announcements to every agent. Peak memory:
the summed RSS of the run's whole process tree (Ray's raylet, GCS and workers included), sampled every 0.2 s,
which over-counts pages shared between processes; and the rise of the machine's used memory over what it was
before the run, which does not (but sees everything else on the machine). The table's header gives the
machine's load (``os.getloadavg``) at the start; below it, the round's physical limit measured on the machine
(benchmarks/limit.py) for each pair of encodings fedmq ran with, and each fedmq row's ratio to its own.
"""

from __future__ import annotations

import dataclasses
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
from fedmq.benchmarks.limit import Limit, usable_cores
from fedmq.benchmarks.limit import measure as measure_limit

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
    encodings: tuple[str, str] | None = None  # fedmq's (uplink, downlink); None for Flower
    summary: dict = field(default_factory=dict)  # fedmq's: the run's summary (the last line simulate prints)


@dataclass
class Bench:
    """One `fedmq bench flower` run: the machine's load at its start, the runs, the round's limit for each
    pair of encodings fedmq ran with."""

    load: tuple[float, float, float]
    cores: int
    runs: list[Run]
    limits: list[Limit] = field(default_factory=list)


@dataclass(frozen=True)
class Setting:
    """What both systems run (module docstring): the task over corpus ``data``, K = ``clients`` clients of
    which ``selected`` train a round, ``rounds`` rounds; a run still going after ``timeout`` s is killed."""

    data: str
    clients: int
    selected: int
    rounds: int
    timeout: float = 1800

    @property
    def fraction(self) -> str:
        """C = selected / K, as both command lines take it."""
        return repr(self.selected / self.clients)


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


def period_median(ends: list[float]) -> float | None:
    """Median of the periods between consecutive round ends: rounds 2..R (round 1 has no previous end)."""
    periods = [b - a for a, b in zip(ends, ends[1:])]
    return statistics.median(periods) if periods else None


def _bytes_median(rows: list[dict]) -> float | None:
    later = [r["bytes_up"] + r["bytes_down"] for r in rows[1:] if "bytes_up" in r and "bytes_down" in r]
    return statistics.median(later) if later else None


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "no output"


def run_fedmq(name: str, setting: Setting, encoding: str = "delta+bf16", down_encoding: str = "bf16") -> Run:
    trainers = usable_cores()  # clients that train at once, one torch thread each (module docstring)
    with tempfile.TemporaryDirectory(prefix="fedmq-bench-") as tmp:
        out = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            "fedmq.cli.app",
            "simulate",
            "--data",
            setting.data,
            "--model",
            "gru-small",
            "--tied",
            "-k",
            str(setting.clients),
            "-c",
            setting.fraction,
            "--max-steps",
            "1",
            "-b",
            "2",
            "--bptt",
            "8",
            "-r",
            str(setting.rounds),
            "--max-eval-lines",
            "1",
            "--encoding",
            encoding,
            "--down-encoding",
            down_encoding,
            "--trainers",
            str(trainers),
            "--out",
            str(out),
            "--log-level",
            "warning",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"} if trainers > 1 else dict(os.environ)
        code, stdout, err, tree, used = _measured(cmd, env, setting.timeout)
        # dicts, as Flower's rows are
        rows = [r.to_json() for r in read_rounds(out).records] if out.is_dir() else []
    run = _run(name, setting, (code, err, tree, used), rows, [r["time"] for r in rows])
    run.encodings = (encoding, down_encoding)
    if code == 0 and stdout.strip():
        run.summary = json.loads(stdout.strip().splitlines()[-1])
    run.bytes_per_round = _bytes_median([r for r in rows if not r.get("skipped")])
    if not run.note and any(r.get("skipped") for r in rows):
        run.note = "skipped rounds"
    return run


def _run(
    name: str, setting: Setting, measured: tuple[int, str, int, int], rows: list[dict], ends: list[float]
) -> Run:
    """A run's Run from its process's (exit code, stderr, peak tree RSS, peak used-memory rise), its rounds'
    rows and their end times; its note says how it failed if it exited non-zero or ran fewer rounds."""
    code, err, tree, used = measured
    run = Run(name, peak_tree_gb=tree / 1e9, peak_used_gb=used / 1e9, rounds=len(rows), raw=rows)
    run.s_per_round = period_median(ends)
    run.bytes_per_round = _bytes_median(rows)
    if code != 0 or len(rows) < setting.rounds:
        run.note = f"exit {code}: {_last_line(err)}"
    return run


def flower_missing(python: Path) -> str | None:
    """Why the Flower venv at ``python`` cannot run the bench, or None."""
    if not Path(python).is_file():
        return (
            f"no Flower venv at {python}: scripts/setup.sh --test creates it, or see docs/benchmarks.md "
            "(a venv with torch and pip install -e '.[bench]')"
        )
    return None


def run_flower(python: Path, setting: Setting, module: str = "flower_app", name: str = "flower 1.41") -> Run:
    """Flower's run of the task: ``module`` is flower_app (the bench's side) or flower_control."""
    missing = flower_missing(python)
    if missing:
        return Run(name, note=missing)
    task = {
        "task": "lm",
        "data": setting.data,
        "model": "gru-small",
        "tied": True,
        "clients": setting.clients,
        "bptt": 8,
        "max_eval_lines": 1,
    }
    train = {"epochs": 1, "batch_size": 2, "lr": 20.0, "clip": 0.25, "max_steps": 1}
    cmd = [
        str(python),
        "-m",
        f"fedmq.benchmarks.{module}",
        "--task",
        json.dumps(task),
        "--train",
        json.dumps(train),
        "--clients",
        str(setting.clients),
        "--fraction",
        setting.fraction,
        "--rounds",
        str(setting.rounds),
    ]
    env = {**os.environ, "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    code, out, err, tree, used = _measured(cmd, env, setting.timeout)
    rows = round_rows(out)
    return _run(name, setting, (code, err, tree, used), rows, [r["end"] for r in rows])


def round_rows(out: str) -> list[dict]:
    """The rounds' JSON rows a Flower run printed. Ray's workers write their log lines to the same stdout,
    and one may land in front of a row without a line break: a row is read from where it starts."""
    rows = []
    for line in out.splitlines():
        at = line.find('{"round"')
        if at < 0:
            continue
        try:
            rows.append(json.loads(line[at:]))
        except ValueError:
            continue
    return rows


def bench_flower(
    data: str,
    clients: int = 100,
    selected: int = 10,
    rounds: int = 5,
    scale: tuple[int, ...] = (),
    flower_python: Path = DEFAULT_FLOWER_PYTHON,
    flower: bool = True,
    control: bool = False,
    limit: bool = True,
) -> Bench:
    bench = Bench(os.getloadavg(), usable_cores(), [])
    runs = bench.runs
    setting = Setting(data, clients, selected, rounds)
    if flower:
        runs.append(run_flower(flower_python, setting))
        if control:
            runs.append(run_flower(flower_python, setting, "flower_control", "flower 1.41 (control)"))
    runs.append(run_fedmq(f"fedmq K={clients}", setting))
    runs.append(run_fedmq(f"fedmq K={clients} raw/raw", setting, "raw", "raw"))
    runs.append(run_fedmq(f"fedmq K={clients} {RECOMMENDED[0]}/{RECOMMENDED[1]}", setting, *RECOMMENDED))
    for k in scale:
        if k != clients:
            runs.append(run_fedmq(f"fedmq K={k}", dataclasses.replace(setting, clients=k)))
    if limit:
        pairs = tuple(dict.fromkeys(r.encodings for r in runs if r.encodings is not None))
        bench.limits = measure_limit(data, clients, selected, pairs)
    return bench


def format_table(bench: Bench) -> str:
    runs = bench.runs
    anchor = next((r for r in runs if r.name == "flower 1.41" and r.s_per_round), None)

    def ratio(value: float | None, ref: float | None) -> str:
        return f"{value / ref:.2f}" if value and ref else "—"

    def num(value: float | None, fmt: str) -> str:
        return format(value, fmt) if value is not None else "—"

    one, five, fifteen = bench.load
    lines = [
        f"load at start {one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min) on {bench.cores} cores; "
        "s/round: period between consecutive rounds' ends (aggregated and validated), median of rounds 2..R",
        "",
        "| run | s/round | × Flower | MB/round | × Flower | peak tree RSS GB | × Flower "
        "| peak used-memory rise GB | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r.name} | {num(r.s_per_round, '.2f')} "
            f"| {ratio(r.s_per_round, anchor and anchor.s_per_round)} "
            f"| {num(r.bytes_per_round and r.bytes_per_round / 1e6, '.1f')} "
            f"| {ratio(r.bytes_per_round, anchor and anchor.bytes_per_round)} "
            f"| {r.peak_tree_gb:.2f} | {ratio(r.peak_tree_gb, anchor and anchor.peak_tree_gb)} "
            f"| {r.peak_used_gb:.2f} | {r.note} |"
        )
    for limit in bench.limits:
        lines += ["", limit.describe()]
        for r in runs:
            if r.encodings == (limit.up, limit.down) and r.s_per_round:
                lines.append(
                    f"{r.name}: {r.s_per_round:.2f} s/round = {r.s_per_round / limit.seconds:.2f} × the limit"
                )
    return "\n".join(lines)
