"""On real RabbitMQ: one authenticated agent among three cannot poison the model into Inf/NaN or
wipe it. It trains honestly, then claims n_samples = 2**52 and uploads either finite weights of 3e38 (the
FedAvg sum overflows) or all zeros (the average becomes ~0). Both pass the NaN/Inf checks; before
aggregator.guards the first made every later round fail and the second wiped the model in one round."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fedmq.aggregator.config import JobConfig
from fedmq.broker.transport import provision
from fedmq.client_agent.agent import Agent
from fedmq.tasks.base import model_state

pytestmark = [pytest.mark.rabbitmq]

HOSTILE = "agent-2"


def poison_agent(fill: float | None):
    class Poison(Agent):
        """Claims 2**52 samples and uploads weights of ``fill`` everywhere (finite, right names and shapes),
        or its honestly trained weights when ``fill`` is None."""

        def _trained_state(self, model):
            state = super()._trained_state(model)
            return state if fill is None else {k: torch.full_like(v, fill) for k, v in state.items()}

        def _prepare(self, trained, held, cfg, rnd, version, result, **hook):
            return super()._prepare(
                trained, held, cfg, rnd, version, dataclasses.replace(result, n_samples=2**52), **hook
            )

    return Poison


@pytest.fixture(scope="module")
def task(tiny_lm):
    return tiny_lm(3)


def run(federation, task, tmp_path, url, job, fill="honest", **bounds):
    # lr 1: the model (norm ~7.8) is ~12 honest steps from zero, so the wipe stands out; at lr 5 it is only
    # ~2.8 steps away in round 1 and no norm bound can tell it from an honest update (docs/reliability.md)
    cfg = JobConfig(
        job=job,
        rounds=2,
        clients=3,
        fraction=1.0,
        lr=1.0,
        max_steps=3,
        batch_size=4,
        heartbeat_s=0.5,
        join_timeout_s=30,
        report_deadline_s=60,
        update_deadline_s=30,
        identity="shared:guest",
        **bounds,
    )
    hostile = Agent if fill == "honest" else poison_agent(fill)
    try:
        engine, _, summary = federation(
            task,
            cfg,
            url,
            tmp_path / job,
            agent_class=lambda i: hostile if f"agent-{i}" == HOSTILE else Agent,
        )
    finally:
        provision.purge(url, job)
    rows = engine.runlog.rows()
    return engine, summary, rows


_HONEST: dict[str, float] = {}


def honest_ppl(federation, task, tmp_path, url, job) -> float:
    """Validation perplexity after two rounds of three honest agents (run once per module)."""
    if "ppl" not in _HONEST:
        _, summary, rows = run(federation, task, tmp_path, url, job + "h")
        assert summary["rounds_completed"] == 2 and all(
            r.guard is None for r in rows
        )  # honest: no bound fires
        _HONEST["ppl"] = rows[-1].valid
    return _HONEST["ppl"]


def finite(engine) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in engine.global_state.values())


@pytest.mark.parametrize("fill", [3e38, 0.0], ids=["overflow-3e38", "wipe-zeros"])
def test_one_hostile_agent_is_left_out_and_quality_holds(
    federation, task, tmp_path, rabbit_url, job_id, fill
):
    honest = honest_ppl(federation, task, tmp_path, rabbit_url, job_id)
    engine, summary, rows = run(federation, task, tmp_path, rabbit_url, job_id, fill)
    assert summary["rounds_completed"] == 2 and finite(engine)
    for row in rows:  # each round: the hostile update is received, named, left out; the honest two are folded
        assert row.received == ("agent-0", "agent-1", HOSTILE)
        assert list(row.guard["dropped"]) == [HOSTILE] and set(row.weights) == {"agent-0", "agent-1"}
        assert len(engine.folded[row.round]) == 2 and math.isfinite(row.valid)
    assert rows[-1].valid < 1.05 * honest  # close to the honest run of three (unbounded: NaN, or 500 = wiped)


def test_a_claimed_2_52_samples_is_capped_to_4x_the_median(federation, task, tmp_path, rabbit_url, job_id):
    engine, summary, rows = run(
        federation, task, tmp_path, rabbit_url, job_id, None
    )  # honest weights, n = 2**52
    assert summary["rounds_completed"] == 2 and finite(engine)
    for (
        row
    ) in rows:  # the median of (n0, n1, 2**52) is max(n0, n1): the hostile weight is 4x the larger honest one
        w = row.weights
        assert row.guard["dropped"] == {} and list(row.guard["capped"]) == [HOSTILE]
        assert w[HOSTILE] / max(w["agent-0"], w["agent-1"]) == pytest.approx(4.0, rel=1e-3)
        assert len(engine.folded[row.round]) == 3  # capped, not dropped: its update is in


def test_without_the_relative_bounds_a_non_finite_aggregate_is_never_published(
    federation, task, tmp_path, rabbit_url, job_id
):
    initial = model_state(task.build_model(0))
    engine, summary, rows = run(
        federation, task, tmp_path, rabbit_url, job_id, 3e38, max_samples_factor=0, norm_bound_factor=0
    )
    assert summary["rounds_completed"] == 0 and summary["version"] == 0 and finite(engine)
    assert all("aggregate not finite" in r.skip_reason and HOSTILE in r.skip_reason for r in rows)
    for name, value in engine.global_state.items():  # the model (and its checkpoint) stayed the initial one
        assert torch.equal(value, initial[name].float())
