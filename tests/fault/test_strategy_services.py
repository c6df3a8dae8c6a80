"""Strategies with server state, client hooks and tensors beside the model (SCAFFOLD) as services over real
RabbitMQ (`fedmq aggregator run`, `fedmq agent run` processes): each ends where its numpy reference does, and
FedAdam's moments and SCAFFOLD's control variates survive a kill -9 of the aggregator: the resumed job's model
equals an uninterrupted run's bit for bit."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from fault_harness import Federation, delete_job_queues, wait_for

from fedmq.aggregator.checkpoint import load_checkpoint

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CLIENTS, ROUNDS = 3, 4


@pytest.fixture(autouse=True)
def examples_on_the_path(monkeypatch):
    """Every process of the job imports the logistic-regression task (docs/examples/logreg.py)."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(ROOT / "docs" / "examples"), os.environ.get("PYTHONPATH", "")])
    )


@pytest.fixture
def references():
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    import test_strategy_references as refs

    return refs


def _federation(base: Path, url: str, job: str, strategy: str, args: dict, refs, **extra) -> Federation:
    options = {
        "strategy": {"name": strategy, **args},
        "fraction": 1.0,
        "lr": refs.LR,
        "max_steps": refs.STEPS,
        "seed": refs.SEED,
        "report_deadline_s": 60.0,
        "update_deadline_s": 60.0,
    }
    return Federation(
        base,
        url,
        job,
        clients=CLIENTS,
        rounds=ROUNDS,
        job_options=options,
        task={"task": "logreg:LogReg", "seed": refs.SEED},
        **extra,
    )


@pytest.mark.any_worker  # kills nothing: it may run beside other tests
@pytest.mark.parametrize("strategy", ["fedprox", "scaffold", "fedavgm", "fedadagrad", "fedadam", "fedyogi"])
def test_strategy_runs_as_services_and_matches_its_reference(
    tmp_path, rabbit_url, job_id, references, strategy
):
    _, args, reference = next(c for c in references.CASES if c[0] == strategy)
    fed = _federation(tmp_path / "fed", rabbit_url, job_id, strategy, args, references)
    try:
        summary = fed.start().wait_aggregator(timeout=180)
    finally:
        fed.stop_all()
        delete_job_queues(rabbit_url, job_id, CLIENTS)
    assert summary["rounds_completed"] == ROUNDS and summary["strategy"] == strategy
    ours, theirs = references.final_model(fed.state), reference(clients=CLIENTS, rounds=ROUNDS)
    assert np.abs(ours - theirs).max() < 1e-6, (ours, theirs)


def _kill9_and_resume(base: Path, url: str, job: str, strategy: str, refs, phase: str):
    """An uninterrupted job and one whose aggregator is killed with SIGKILL at ``phase`` of round 3 (the
    phases of fault_plan.AGG_PHASES) and restarted: their final checkpoints."""
    args = dict(next(c for c in refs.CASES if c[0] == strategy)[1])
    whole = _federation(base / "whole", url, job + "w", strategy, args, refs)
    killed = _federation(
        base / "killed",
        url,
        job + "k",
        strategy,
        args,
        refs,
        # round 3 stays open long enough to be killed in; before-agg: every agent has trained, none reported
        agent_faults={i: "slow:1.0:3" for i in (range(CLIENTS) if phase == "before-agg" else [2])},
    )
    reached = {
        "before-agg": lambda: (
            killed.round_open(3)
            and all(killed.agent_events(i, "round training", 3) for i in range(CLIENTS))
            and not killed.spooled_updates(3)
        ),
        "during-agg": lambda: killed.round_open(3) and killed.spooled_updates(3) >= 1,
        "after-agg": lambda: killed.round_closed(3),
    }[phase]
    try:
        whole.start().wait_aggregator(timeout=180)
        killed.start()
        wait_for(reached, 120, f"{phase} in round 3")
        killed.kill9("agg")
        killed.start_aggregator("agg2")
        summary = killed.wait_aggregator("agg2", timeout=180)
    finally:
        for fed in (whole, killed):
            fed.stop_all()
            delete_job_queues(url, fed.job, CLIENTS)
    assert summary["rounds_completed"] == ROUNDS
    if phase != "after-agg":
        assert killed.agg_events("resuming open round"), "the restart did not resume the open round"
    a, b = load_checkpoint(whole.state / "checkpoints"), load_checkpoint(killed.state / "checkpoints")
    assert sorted(a.global_state) == sorted(b.global_state)
    assert all(torch.equal(a.global_state[k], b.global_state[k]) for k in a.global_state)
    theirs = next(c for c in refs.CASES if c[0] == strategy)[2](clients=CLIENTS, rounds=ROUNDS)
    assert np.abs(refs.flat(b.global_state) - theirs).max() < 1e-6
    return a, b


def test_fedadam_resumes_bit_for_bit_after_kill9_of_the_aggregator(tmp_path, rabbit_url, job_id, references):
    a, b = _kill9_and_resume(tmp_path, rabbit_url, job_id, "fedadam", references, "during-agg")
    assert b.strategy_state["fedadam"]["m"]  # the moments are in the checkpoint
    for moment in ("m", "v"):
        sa, sb = a.strategy_state["fedadam"][moment], b.strategy_state["fedadam"][moment]
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("phase", ["before-agg", "during-agg", "after-agg"])
def test_scaffold_resumes_bit_for_bit_after_kill9_of_the_aggregator(
    tmp_path, rabbit_url, job_id, references, phase
):
    """The control variates: the server's c in the checkpoint, each client's c_i in its agent."""
    _, b = _kill9_and_resume(tmp_path, rabbit_url, job_id, "scaffold", references, phase)
    assert any(k.startswith("scaffold.c:") for k in b.global_state)
