"""The optional robust guard (JobConfig.robust) against an authenticated but faulty agent,
in-process broker."""

from __future__ import annotations

import re

import pytest
import torch
from quick_jobs import quick_job

from fedmq.aggregator.config import JobConfig, JobConfigError
from fedmq.client_agent.agent import Agent


class PoisonAgent(Agent):
    """Trains honestly, then uploads weights of 1e4 everywhere (finite, right names and shapes)."""

    def _trained_state(self, model):
        return {k: torch.full_like(v, 1e4) for k, v in super()._trained_state(model).items()}


@pytest.fixture(scope="module")
def task(tiny_lm):
    return tiny_lm(3)


def run(federation, task, tmp_path, robust: str, folded: int = 3, **bounds) -> float:
    name = f"robust-{robust.replace(':', '-').replace('.', '_')}-{len(bounds)}"
    cfg = quick_job(name, rounds=1, clients=3, lr=5.0, robust=robust, **bounds)
    engine, _, summary = federation(
        task,
        cfg,
        f"memory://{name}",
        tmp_path / name,
        evaluate=False,
        agent_class=lambda i: PoisonAgent if i == 2 else Agent,
    )
    assert summary["rounds_completed"] == 1 and len(engine.folded[1]) == folded
    return max(float(v.abs().max()) for v in engine.global_state.values())


def test_median_and_clipping_keep_a_poisoned_update_out(federation, task, tmp_path):
    assert (
        run(federation, task, tmp_path, "none", norm_bound_factor=0) > 3000
    )  # plain FedAvg: a third of 1e4 gets in
    assert (
        run(federation, task, tmp_path, "none", folded=2) < 50
    )  # the default norm bound (aggregator.guards) drops it
    off = dict(norm_bound_factor=0)  # the robust strategies keep it out on their own
    assert (
        run(federation, task, tmp_path, "median", **off) < 50
    )  # coordinate-wise median of three ignores the outlier
    assert run(federation, task, tmp_path, "clip:1.0", **off) < 50  # the outlier's delta is clipped to norm 1


def test_bad_robust_setting_is_one_clear_error():
    with pytest.raises(JobConfigError, match=re.escape("robust (--robust)")):
        JobConfig(robust="clip:-1")
