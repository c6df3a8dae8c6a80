"""In-process broker: the influence guard (aggregator.guards) keeps its norm rule when its reference is zero
or missing.

* A plateau (lr annealed to ~0: the honest deltas are exactly 0, so the round's median norm is 0): the norm
  rule was skipped, one agent's zeros with n = 2**52 were only capped (4/6 of the weight: the model shrank
  to a third each round), and 3e38 made the aggregate non-finite (the honest round skipped). Now, against a
  zero reference, any change is out of bounds: both are dropped and the round goes on.
* No reference at all (the first update of an asynchronous job): zeros (Δ = −θ) with n = 2**52 were folded
  with the whole weight. Now an update with no reference is shortened to move the model by at most half its
  norm (an honest first step of a small model may be as long, and dropping it would leave the job without a
  reference for ever).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.guards import RoundGuard, norm_of
from fedmq.aggregator.strategies.base import ClientUpdate
from fedmq.client_agent.agent import Agent
from fedmq.tasks.base import model_state


@pytest.fixture(scope="module")
def task(tiny_lm):
    return tiny_lm(3)


class Plateau(Agent):
    """An honest agent on a plateau: local training no longer changes the model (it uploads what it got)."""

    def _trained_state(self, model):
        return {k: v.detach().clone() for k, v in self.held.items() if k in self.manifest.names}

    def _prepare(self, model, held, cfg, rnd, version, result, **hook):
        self.held = held
        return super()._prepare(model, held, cfg, rnd, version, result, **hook)


def hostile(fill: float):
    class Hostile(Plateau):
        """Claims n = 2**52 and uploads ``fill`` everywhere."""

        def _trained_state(self, model):
            return {k: torch.full_like(v, fill) for k, v in super()._trained_state(model).items()}

        def _prepare(self, model, held, cfg, rnd, version, result, **hook):
            result = dataclasses.replace(result, n_samples=2**52)
            return super()._prepare(model, held, cfg, rnd, version, result, **hook)

    return Hostile


@pytest.mark.parametrize("fill", [0.0, 3e38], ids=["wipe-zeros", "overflow-3e38"])
def test_a_plateau_does_not_disarm_the_norm_rule(federation, task, tmp_path, fill):
    job = f"plateau-{'zeros' if fill == 0 else 'overflow'}"
    cfg = JobConfig(
        job=job,
        rounds=2,
        clients=3,
        fraction=1.0,
        lr=1.0,
        max_steps=1,
        batch_size=4,
        heartbeat_s=0.5,
        join_timeout_s=20,
        report_deadline_s=30,
        update_deadline_s=30,
    )
    bad = hostile(fill)
    engine, _, summary = federation(
        task,
        cfg,
        f"memory://{job}",
        tmp_path / job,
        evaluate=False,
        agent_class=lambda i: bad if i == 2 else Plateau,
    )
    rows = engine.runlog.rows()
    assert summary["rounds_completed"] == 2, [r.skip_reason for r in rows]
    for row in rows:
        assert list(row.guard["dropped"]) == ["agent-2"] and set(row.weights) == {"agent-0", "agent-1"}
    initial = model_state(task.build_model(cfg.seed))
    for name, value in initial.items():  # the plateau holds: neither wiped nor overflowed
        assert torch.equal(engine.global_state[name], value.float()), name


def test_a_first_update_with_no_reference_cannot_wipe_the_model(task):
    model = {k: v.float() for k, v in model_state(task.build_model(0)).items()}
    guard = RoundGuard(4.0, 10.0)
    guard.begin()
    wipe = ClientUpdate("evil", 2**52, {k: -v for k, v in model.items()}, delta=True)  # θ_k = 0
    assert guard.screen(wipe, model) is None and "evil" in guard.screened.capped
    assert norm_of(wipe.tensors.values()) == pytest.approx(0.5 * norm_of(model.values()), rel=1e-5)
    step = ClientUpdate("a", 100, {k: 0.01 * torch.ones_like(v) for k, v in model.items()}, delta=True)
    before = {k: v.clone() for k, v in step.tensors.items()}
    assert guard.screen(step, model) is None  # an honest-sized first update is folded as it came
    assert all(torch.equal(step.tensors[k], before[k]) for k in before) and "a" not in guard.screened.capped
    # the same wipe sent as full weights (θ_k = 0) is shortened the same way: θ + ½(θ_k − θ) = ½θ
    guard.begin()
    full = ClientUpdate("evil", 2**52, {k: torch.zeros_like(v) for k, v in model.items()}, delta=False)
    assert guard.screen(full, model) is None
    assert all(torch.allclose(full.tensors[k], 0.5 * model[k], atol=1e-6) for k in model)
