"""In-process broker: the influence guard (aggregator.guards) keeps its norm rule when its reference is zero
or missing.

* A plateau (lr annealed to ~0: the honest deltas are exactly 0, so the round's median norm is 0): the norm
  rule was skipped, one agent's zeros with n = 2**52 were only capped (4/6 of the weight: the model shrank
  to a third each round), and 3e38 made the aggregate non-finite (the honest round skipped). Now, against a
  zero reference, any change is out of bounds: both are dropped and the round goes on.
* No reference at all (the first updates of an asynchronous job): zeros (Δ = −θ) with n = 2**52 were folded
  with the whole weight. Now updates with no reference are held and judged together at the buffer's close, as
  a synchronous round: with fewer than three and no history, beyond half the model's norm is dropped
  (tests/hostile/test_guard_first_buffer.py runs whole first buffers).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.guards import RoundGuard
from fedmq.aggregator.strategies.base import ClientUpdate
from fedmq.client_agent.agent import Agent
from fedmq.tasks.base import model_state


@pytest.fixture(scope="module")
def task(tiny_lm):
    return tiny_lm(3)


class Plateau(Agent):
    """An honest agent on a plateau: local training no longer changes the model (it uploads what it got)."""

    def _plateau_state(self, held):
        return {k: v.detach().clone() for k, v in held.items() if k in self.manifest.names}

    def _prepare(self, trained, held, cfg, rnd, version, result, **hook):
        return super()._prepare(self._plateau_state(held), held, cfg, rnd, version, result, **hook)


def hostile(fill: float):
    class Hostile(Plateau):
        """Claims n = 2**52 and uploads ``fill`` everywhere."""

        def _plateau_state(self, held):
            return {k: torch.full_like(v, fill) for k, v in super()._plateau_state(held).items()}

        def _prepare(self, trained, held, cfg, rnd, version, result, **hook):
            result = dataclasses.replace(result, n_samples=2**52)
            return super()._prepare(trained, held, cfg, rnd, version, result, **hook)

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
    assert guard.screen(wipe, model) is None and "evil" in guard.held  # nothing to judge it by yet
    step = ClientUpdate("a", 100, {k: 0.01 * torch.ones_like(v) for k, v in model.items()}, delta=True)
    assert guard.screen(step, model) is None
    # judged at the buffer's close: two updates, no history, so the no-reference rule: the wipe is dropped
    verdict = guard.judge_held(model)
    assert list(verdict.dropped) == ["evil"] and "no reference yet" in verdict.dropped["evil"]
    assert verdict.capped == {} and guard.latest["a"][0] == 100  # 4 x the smaller claim: a is not capped
    # the same wipe sent as full weights (θ_k = 0) is the same change
    guard = RoundGuard(4.0, 10.0)
    guard.begin()
    full = ClientUpdate("evil", 2**52, {k: torch.zeros_like(v) for k, v in model.items()}, delta=False)
    assert guard.screen(full, model) is None
    assert list(guard.judge_held(model).dropped) == ["evil"]
