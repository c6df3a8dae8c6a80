"""Strategies with server state, client hooks and tensors beside the model (SCAFFOLD) as services over real
RabbitMQ (`fedmq aggregator run`, `fedmq agent run` processes): each ends where its numpy reference does, and
FedAdam's moments survive a kill -9 of the aggregator: the resumed job's model equals an uninterrupted run's
bit for bit."""

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


def test_fedadam_resumes_bit_for_bit_after_kill9_of_the_aggregator(tmp_path, rabbit_url, job_id, references):
    args = dict(next(c for c in references.CASES if c[0] == "fedadam")[1])
    whole = _federation(tmp_path / "whole", rabbit_url, job_id + "w", "fedadam", args, references)
    killed = _federation(
        tmp_path / "killed",
        rabbit_url,
        job_id + "k",
        "fedadam",
        args,
        references,
        agent_faults={2: "slow:1.0:3"},  # round 3 stays open long enough to be killed in
    )
    try:
        whole.start().wait_aggregator(timeout=180)
        killed.start()
        wait_for(
            lambda: killed.round_open(3) and killed.spooled_updates(3) >= 1,
            120,
            "an update spooled in round 3",
        )
        before = load_checkpoint(killed.state / "checkpoints")
        assert (
            before.round == 3 and before.strategy_state["fedadam"]["m"]
        )  # the moments are in the checkpoint
        killed.kill9("agg")
        killed.start_aggregator("agg2")
        summary = killed.wait_aggregator("agg2", timeout=180)
    finally:
        for fed in (whole, killed):
            fed.stop_all()
            delete_job_queues(rabbit_url, fed.job, CLIENTS)
    assert summary["rounds_completed"] == ROUNDS
    assert killed.agg_events("resuming open round"), "the restart did not resume the open round"
    a, b = load_checkpoint(whole.state / "checkpoints"), load_checkpoint(killed.state / "checkpoints")
    assert all(torch.equal(a.global_state[k], b.global_state[k]) for k in a.global_state)
    for moment in ("m", "v"):
        sa, sb = a.strategy_state["fedadam"][moment], b.strategy_state["fedadam"][moment]
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    theirs = next(c for c in references.CASES if c[0] == "fedadam")[2](clients=CLIENTS, rounds=ROUNDS)
    assert np.abs(references.flat(b.global_state) - theirs).max() < 1e-6
