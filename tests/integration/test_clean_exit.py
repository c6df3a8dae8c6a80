"""A run that ends while local training is still inside torch exits cleanly: exit code 0 (130 after Ctrl-C,
1 with one line when no round completed), never SIGABRT with "terminate called without an active exception" on
stderr.

Python ends a daemon thread that takes the GIL back after the interpreter began to exit, and a thread doing so
in torch's C++ code aborts the whole process (exit code 134). Every run below ends with local training under
way (exit_tasks.SlowTask trains for 30 s unless stopped): a synchronous round closed by its deadlines, an
asynchronous version folded from a first, fast update, Ctrl-C in the middle of a round, and the Python API.
Before the trainer pool stopped local training and the run waited for it, each of these runs aborted whenever
training outlived the run's 10 s wait for its agents: every one of them here. Each process must also end
before that training would: the run stops it at its next step, so no training runs until its time is up
(SlowTask's TRAINED line never appears).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fedmq_procs
import pytest
from load_factor import budget

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# per scenario: 2 runs side by side, 8 processes in all; each run aborted before the fix, so one is enough to
# catch it (FEDMQ_TEST_EXIT_RUNS=13 for a longer check: 52)
RUNS = int(os.environ.get("FEDMQ_TEST_EXIT_RUNS", "2"))
ABORT = "terminate called"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
SLOW = ["--task", "exit_tasks:SlowTask"]
DEADLINES = ["--report-deadline", "1", "--update-deadline", "1"]


fedmq = fedmq_procs.command  # the command line of `fedmq ARGS`


def exit_tasks():
    """tests/integration/exit_tasks.py, the module the runs below import by name."""
    sys.path.insert(0, str(HERE))
    try:
        import exit_tasks
    finally:
        sys.path.remove(str(HERE))
    return exit_tasks


def finish(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget(120), cwd=ROOT, env=env or ENV)
    return proc.returncode, proc.stderr


def many(run_one, n: int = RUNS) -> list[tuple[int, str]]:
    with ThreadPoolExecutor(2) as ex:
        return list(ex.map(run_one, range(n)))


def check(results: list[tuple[int, str]], code: int) -> None:
    trained = exit_tasks().TRAINED
    for rc, err in results:
        assert ABORT not in err, err[-1500:]
        assert rc == code, (rc, err[-1500:])
        assert trained not in err, "the run waited for local training to end"


def test_sync_runs_whose_round_closed_on_its_deadline_exit_1_in_one_line(tmp_path):
    """The selected agent is still training when the round closes without it and the job ends: cleanly, and,
    as that job completed no round, with exit code 1 and one line saying so."""
    results = many(
        lambda i: finish(
            fedmq("simulate", *SLOW, "-k", "2", "-r", "1", *DEADLINES, "--out", str(tmp_path / f"r{i}"))
        )
    )
    check(results, 1)
    for _, err in results:
        assert [line for line in err.splitlines() if line.startswith("error:")] == [
            "error: no round completed: all 1 round(s) skipped (1 for 0 update(s) < min 1)"
        ], err[-1500:]


def test_async_runs_ending_with_agents_still_training_exit_0(tmp_path):
    """The first update (a fast one) makes the last version; the other agents are still training."""
    job = tmp_path / "job.toml"
    job.write_text('strategy = "async"\nasync_k = 1\n')
    env = {**ENV, "EXIT_TASK_FAST": "1"}
    cmd = ["simulate", *SLOW, "--config", str(job), "-k", "4", "-c", "1", "-r", "1"]
    check(many(lambda i: finish(fedmq(*cmd, "--out", str(tmp_path / f"r{i}")), env)), 0)


def test_ctrl_c_while_agents_train_exits_130(tmp_path):
    def interrupted(i: int) -> tuple[int, str]:
        out = tmp_path / f"r{i}"
        proc = subprocess.Popen(
            fedmq("simulate", *SLOW, "-k", "2", "-r", "2", "--out", str(out)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=ENV,
        )
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:  # the JSON log (not a terminal): wait until an agent trains
            lines.append(line)
            if "round training" in line:
                break
        proc.send_signal(signal.SIGINT)
        err = "".join(lines) + proc.stderr.read()
        return proc.wait(timeout=budget(120)), err

    check(many(interrupted), 130)


API_SCRIPT = """
import sys
from pathlib import Path
import fedmq
from exit_tasks import SlowTask

cfg = fedmq.JobConfig(job="exit", rounds=1, clients=2, report_deadline_s=1, update_deadline_s=1)
summary = fedmq.Simulation(cfg, SlowTask(clients=2), run_dir=Path(sys.argv[1])).run()
print(summary["rounds_skipped"])
"""


def test_python_api_runs_exit_0(tmp_path):
    script = tmp_path / "api_run.py"
    script.write_text(API_SCRIPT)
    check(many(lambda i: finish([sys.executable, str(script), str(tmp_path / f"r{i}")])), 0)


def test_the_task_trains_until_its_time_is_up_unless_stopped(capsys):
    """The scenarios above prove something only if SlowTask's training outlives the run by itself, and says
    so when it ran until its time was up."""
    tasks = exit_tasks()
    import fedmq

    task = tasks.SlowTask(clients=1, slow_s=0.3)
    t0 = time.monotonic()
    result = task.train(task.build_model(), 0, fedmq.TrainConfig())
    # the slow branch, whatever the machine's speed (a busy one may take no more steps than a fast training)
    assert time.monotonic() - t0 >= 0.3 and result.steps >= 1
    assert capsys.readouterr().err.splitlines() == [tasks.TRAINED]

    def stop(done: int, total: int) -> None:
        if done == 2:
            raise RuntimeError("stopped")

    with pytest.raises(RuntimeError, match="stopped"):
        task.train(task.build_model(), 0, fedmq.TrainConfig(), stop)
    assert tasks.TRAINED not in capsys.readouterr().err
