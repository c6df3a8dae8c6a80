"""In-process broker: an asynchronous job's first buffer is judged as a synchronous round is
(aggregator.guards).

Before, an update that arrived while fewer than two other clients had an accepted update (the first ones of
a job) was shortened to move the model by at most half its norm and folded with its claimed n uncapped: a
first update of −θ + noise with n = 2**52 took almost the whole weight of version 1 and halved the model.
Now such updates are held and judged together when the buffer closes: against the buffer's own lower median
(three updates or more), else the no-reference rule (dropped beyond half the model's norm).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from load_factor import budget
from quick_jobs import quick_job

from fedmq.client_agent.agent import Agent
from fedmq.tasks.base import model_state

CLIENTS = 3


def agent_classes(kind: str) -> tuple[type[Agent], type[Agent]]:
    """(the hostile agent's class, the honest agents' class): the honest ones upload once the hostile
    upload is confirmed, so that it is the first update of the job."""
    first = threading.Event()

    class Hostile(Agent):
        """Claims n = 2**52 and uploads ``kind``: "wipe" θ_k = noise (Δ ≈ −θ), "huge" Δ = 1e6 × its honest
        step, "honest" its honest step."""

        def _prepare(self, trained, held, cfg, rnd, version, result, **hook):
            result = dataclasses.replace(result, n_samples=2**52)
            return super()._prepare(self._hostile(trained, held), held, cfg, rnd, version, result, **hook)

        def _hostile(self, trained, held):
            gen = torch.Generator().manual_seed(7)
            if kind == "wipe":
                return {k: 1e-3 * torch.randn(v.shape, generator=gen) for k, v in trained.items()}
            if kind == "huge":
                return {k: held[k] + 1e6 * (v - held[k]) for k, v in trained.items()}
            return trained

        def _upload(self, rnd, version, prepared):
            super()._upload(rnd, version, prepared)
            first.set()

    class Honest(Agent):
        def _upload(self, rnd, version, prepared):
            assert first.wait(budget(60)), "the hostile agent never uploaded"
            super()._upload(rnd, version, prepared)

    return Hostile, Honest


def _first_version(federation, tiny_lm, tmp_path, kind: str):
    """One version of an async job, buffer_size 3, agent-0 hostile: (version 1, row, honest uploads, θ_0)."""
    task = tiny_lm(CLIENTS)
    job = f"first-buffer-{kind}"
    cfg = quick_job(
        job,
        strategy="async",
        strategy_args={"buffer_size": CLIENTS, "max_staleness": 2},
        rounds=1,
        clients=CLIENTS,
        report_deadline_s=60,
        update_deadline_s=60,
        encoding="raw",  # exact models both ways: version 1 is compared with what the agents uploaded
        down_encoding="raw",
    )
    bad, honest = agent_classes(kind)
    engine, agents, summary = federation(
        task,
        cfg,
        f"memory://{job}",
        tmp_path / job,
        evaluate=False,
        keep_sent=True,
        agent_class=lambda i: bad if i == 0 else honest,
    )
    assert summary["version"] == 1, summary
    (row,) = engine.runlog.rows()
    honest = [sent for a in agents[1:] for _, sent in a.log.sent.values()]
    theta0 = {k: v.float() for k, v in model_state(task.build_model(cfg.seed)).items()}
    return engine.global_state, row, honest, theta0


@pytest.mark.parametrize("kind", ["wipe", "huge"])
def test_garbage_in_the_first_buffer_is_dropped(federation, tiny_lm, tmp_path, kind):
    model, row, honest, theta0 = _first_version(federation, tiny_lm, tmp_path, kind)
    assert "agent-0" in row.received, row.received  # the first update of the job
    assert "agent-0" in row.guard["dropped"] and "agent-0" not in row.weights, (row.guard, row.weights)
    # version 1 is a weighted mean of honest models (or θ_0 when no honest update was in it): each of its
    # numbers lies between the smallest and the largest of θ_0's and the honest uploads'
    for name, value in model.items():
        if name not in theta0:
            continue
        stack = torch.stack([theta0[name]] + [h[name].float() for h in honest])
        lo, hi = stack.min(0).values, stack.max(0).values
        over = torch.maximum(lo - value, value - hi).max().item()
        assert over <= 1e-6, (name, over)


def test_a_huge_claim_in_the_first_buffer_is_capped(federation, tiny_lm, tmp_path):
    _, row, _, _ = _first_version(federation, tiny_lm, tmp_path, "honest")
    others = [c for c in row.received if c != "agent-0"]
    assert "agent-0" in row.received and others, row.received
    # 4 x the buffer's lower median n (three updates) or the smaller claim (two): at most 4/5 of the weight
    assert row.guard["capped"].get("agent-0", 2**52) < 2**52, row.guard
    assert row.weights["agent-0"] <= 0.8 + 1e-6, row.weights
