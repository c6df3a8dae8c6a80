"""A job's progress is told: ``Simulation(on_round=fn)`` hears of every round as it closes, and a job that
cannot make progress says so: a run whose every round is skipped (here a strategy refuses every
update) ends with one line saying no round completed and why, and `fedmq simulate` exits 1, not 0; a parameter
only the client side refuses fails the command at once with exit code 2."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import fedmq_procs
import pytest

import fedmq
from fedmq.cli.errors import NoRoundCompleted, check_progress

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
REFUSING = """
import fedmq


class Refuses(fedmq.FedAvg):
    name = "refuses"

    def fold(self, update):
        raise fedmq.BadParameter("this strategy takes no update")
"""


@pytest.fixture
def refusing(tmp_path, monkeypatch):
    folder = tmp_path / "mods"
    folder.mkdir()
    (folder / "refusing_strategy.py").write_text(REFUSING)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield folder
    sys.modules.pop("refusing_strategy", None)


def _cfg(**over) -> fedmq.JobConfig:
    base = {"job": "stuck", "rounds": 2, "clients": 2, "fraction": 1.0, "lr": 0.5, "max_steps": 2}
    # a refused update is waited for until the round's deadlines: keep them short
    return fedmq.JobConfig(**{**base, **over})


def test_a_run_with_no_completed_round_says_why(tmp_path, refusing):
    from logreg import LogReg

    summary = fedmq.Simulation(
        _cfg(strategy="refusing_strategy:Refuses", report_deadline_s=1.0, update_deadline_s=1.0),
        LogReg(clients=2),
        run_dir=tmp_path / "run",
    ).run()
    line = summary["no_round_completed"]
    assert summary["rounds_completed"] == 0 and not summary["interrupted"]
    assert line.startswith("no round completed: all 2 round(s) skipped (2 for 0 update(s) < min 1)")
    with pytest.raises(NoRoundCompleted, match="no round completed") as err:
        check_progress(summary)
    assert err.value.exit_code == 1


def test_a_run_that_completed_rounds_passes(tmp_path):
    sys.path.insert(0, str(EXAMPLES))
    from logreg import LogReg

    rows: list[dict] = []
    summary = fedmq.Simulation(
        _cfg(), LogReg(clients=2), run_dir=tmp_path / "run", on_round=rows.append
    ).run()
    assert [(r["round"], r["skipped"]) for r in rows] == [(1, False), (2, False)]
    assert summary["rounds_completed"] == 2 and summary["no_round_completed"] is None
    assert summary["inbox_left"] == 0  # the in-process broker's queues go with the run
    check_progress(summary)


def _simulate(tmp_path: Path, folder: Path, *args: str) -> tuple[int, str]:
    """`fedmq simulate` of a small logistic regression: its exit code and its one error line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(EXAMPLES)]), "OMP_NUM_THREADS": "1"}
    flags = ["--task", "logreg:LogReg", "-k", "2", "-c", "1", "-r", "2", "--max-steps", "2", "--json"]
    done = fedmq_procs.run(
        fedmq_procs.command("simulate", *flags, "--out", str(tmp_path / "run"), *args),
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        cwd=tmp_path,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return done.returncode, errors[0]


def test_simulate_exits_1_when_no_round_completed(tmp_path, refusing):
    deadlines = ["--report-deadline", "1", "--update-deadline", "1"]
    code, error = _simulate(tmp_path, refusing, "--strategy", "refusing_strategy:Refuses", *deadlines)
    assert code == 1 and "no round completed" in error, error


def test_simulate_refuses_a_parameter_only_the_client_hook_checks(tmp_path):
    strategy = ["--strategy", "own_strategy:DecayingFedAvg", "--strategy-arg", "max_norm=-0.5"]
    code, error = _simulate(tmp_path, EXAMPLES, *strategy)
    assert code == 2 and "max_norm must be positive" in error, error
