"""The public Python API: a Task and a Strategy defined outside the package (docs/examples/bring_your_own.py)
run in-process from Python, by `fedmq simulate --task/--strategy package.module:Class`, and as services over
RabbitMQ; a class that cannot be used is one line."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import fedmq_procs
import pytest
from load_factor import budget

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")]),
    "OMP_NUM_THREADS": "1",
}
OWN = ["--task", "bring_your_own:TwoMoons", "--strategy", "bring_your_own:UniformMean"]


def fedmq(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return fedmq_procs.fedmq(*args, env=ENV, timeout=timeout)


def test_the_example_runs_from_python_and_learns(tmp_path):
    spec = importlib.util.spec_from_file_location("bring_your_own", EXAMPLES / "bring_your_own.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules["bring_your_own"] = example  # the job names its strategy by this import path
    try:
        spec.loader.exec_module(example)
        chance = example.TwoMoons(clients=8).evaluate(example.TwoMoons().build_model(0))
        summary = example.main(tmp_path / "run")
    finally:
        del sys.modules["bring_your_own"]
    assert (
        summary["rounds_completed"] == 5 and summary["metric"] == "accuracy" and summary["higher_is_better"]
    )
    assert summary["strategy"] == "bring_your_own:UniformMean"
    assert summary["best_valid"] > max(0.75, chance + 0.15), (chance, summary["best_valid"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and all(
        len(r["received"]) == 8 for r in rows
    )  # its plan: all 8, not C = 0.25 of them
    assert all(set(r["weights"].values()) == {1 / 8} for r in rows)  # the strategy's own weights: uniform


def test_simulate_takes_a_task_and_a_strategy_by_import_path(tmp_path):
    out = tmp_path / "run"
    done = fedmq(
        "simulate",
        *OWN,
        "-k",
        "4",
        "-r",
        "2",
        "--lr",
        "0.5",
        "-b",
        "16",
        "--out",
        str(out),
        "--log-level",
        "warning",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert summary["rounds_completed"] == 2 and summary["metric"] == "accuracy"
    assert config["strategy"] == "bring_your_own:UniformMean" and config["task"] == "two-moons"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--task", "no_such_module:Task"],
            "cannot import task module 'no_such_module': ModuleNotFoundError",
        ),
        (
            ["--task", "bring_your_own:UniformMean"],
            "must name a subclass of fedmq.tasks.base.Task; found UniformMean",
        ),
        (
            ["--task", "bring_your_own:Nothing"],
            "must name a subclass of fedmq.tasks.base.Task; found nothing",
        ),
        (
            ["--task", "bring_your_own:TwoMoons", "--strategy", "bring_your_own:TwoMoons"],
            "must name a subclass of fedmq.aggregator.strategies.base.Strategy; found TwoMoons",
        ),
        (
            ["--task", "bring_your_own:TwoMoons", "--strategy", "bring_your_own"],
            "unknown strategy 'bring_your_own'",
        ),
    ],
)
def test_a_class_that_cannot_be_used_is_one_line_and_leaves_nothing(tmp_path, args, message):
    out = tmp_path / "run"
    done = fedmq("simulate", *args, "-k", "2", "-r", "1", "--out", str(out))
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert message in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.rabbitmq
def test_own_task_and_strategy_as_services(tmp_path, rabbit_url, job_id):
    job = tmp_path / "job.toml"
    job.write_text(
        "rounds = 2\nclients = 2\nfraction = 1.0\nheartbeat_s = 1.0\njoin_timeout_s = 60.0\nlr = 0.5\n"
        'batch_size = 16\nidentity = "shared:guest"\nstrategy = "bring_your_own:UniformMean"\n\n'
        '[task]\ntask = "bring_your_own:TwoMoons"\n'
    )
    common = ["--broker", rabbit_url, "--job", job_id, "--config", str(job)]
    run = fedmq_procs.command()
    agg = fedmq_procs.popen(
        [*run, "aggregator", "run", *common, "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=ENV,
    )
    agents = [
        fedmq_procs.popen(
            [*run, "agent", "run", *common, "--client-id", f"agent-{i}", "--device", "cpu"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=ENV,
        )
        for i in range(2)
    ]
    try:
        _, err = agg.communicate(timeout=120)
        assert agg.returncode == 0, err[-2000:]
        for a in agents:
            assert a.wait(timeout=budget(60)) == 0, a.stderr.read()[-2000:]
    finally:
        for p in (agg, *agents):
            if p.poll() is None:
                p.kill()
    summary = json.loads((tmp_path / "state" / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and summary["metric"] == "accuracy"
    assert summary["strategy"] == "bring_your_own:UniformMean"


def test_the_python_api_refuses_a_run_folder_that_holds_a_run_unless_resumed(tmp_path):
    """One run per folder, as `fedmq simulate --out`: rerunning the example into its folder is one line (exit
    code 2) and leaves the run as it was; ``resume=True`` continues it with no round logged twice."""
    run = tmp_path / "run"
    script = [sys.executable, str(EXAMPLES / "bring_your_own.py"), str(run)]
    first = fedmq_procs.run(script, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    metrics = (run / "metrics.jsonl").read_text()
    again = fedmq_procs.run(script, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=120)
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.strip().splitlines() == [
        f"error: run_dir {run} already holds a run (config.json); pass resume=True to continue it, "
        "or choose another run_dir"
    ]
    assert (run / "metrics.jsonl").read_text() == metrics

    import fedmq

    sys.path.insert(0, str(EXAMPLES))
    try:
        from bring_your_own import TwoMoons
    finally:
        sys.path.remove(str(EXAMPLES))
    cfg = fedmq.JobConfig(job="byo-resume", rounds=2, clients=4, lr=0.5, batch_size=16)
    fresh = tmp_path / "fresh"
    with pytest.raises(fedmq.RunFolderInUse, match="needs a run to continue"):
        fedmq.Simulation(cfg, TwoMoons(clients=4), run_dir=fresh, resume=True).run()
    assert not fresh.exists()
    fedmq.Simulation(cfg, TwoMoons(clients=4), run_dir=fresh).run()
    with pytest.raises(fedmq.RunFolderInUse, match="already holds a run"):
        fedmq.Simulation(cfg, TwoMoons(clients=4), run_dir=fresh).run()
    longer = fedmq.JobConfig(job="byo-resume", rounds=3, clients=4, lr=0.5, batch_size=16)
    summary = fedmq.Simulation(longer, TwoMoons(clients=4), run_dir=fresh, resume=True).run()
    rows = [json.loads(line) for line in (fresh / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds_completed"] == 3 and [r["round"] for r in rows] == [1, 2, 3]
