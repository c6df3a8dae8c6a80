"""`fedmq simulate --cohort`: a round's selected agents train as one batched model, and the federation ends
where the one-at-a-time run ends (up to float summation order)."""

from __future__ import annotations

import pytest

from fedmq.aggregator.config import JobConfig
from fedmq.simulation import Simulation
from fedmq.tasks.registry import make_task


def test_a_cohort_run_trains_each_round_together_and_scores_as_one_at_a_time(tmp_path):
    task = make_task(
        "lm",
        data="builtin",
        model="gru-tiny",
        emb=24,
        hidden=24,
        clients=6,
        vocab_size=500,
        max_lines=1200,
        max_eval_lines=200,
        seed=0,
    )

    def run(name: str, cohort: bool) -> tuple[Simulation, dict]:
        cfg = JobConfig(
            job=f"cohort-{name}",
            strategy="fedatt",
            rounds=2,
            clients=6,
            fraction=0.5,
            lr=0.5,
            momentum=0.5,
            batch_size=4,
            epochs=2,
            clip=0.0,
            heartbeat_s=1.0,
            seed=0,
        )
        sim = Simulation(cfg, task, f"memory://{name}", run_dir=tmp_path / name, cohort=cohort)
        return sim, sim.run()

    alone_sim, alone = run("alone", False)
    together_sim, together = run("together", True)
    assert together_sim.pool.cohorts == [3, 3]  # each round's three selected clients, trained as one
    assert together_sim.pool._free.empty()  # closed with its run: no models kept per run
    # the three report together once the last has trained: the report deadline is one client's, times three
    assert (
        together_sim.engine.cfg.report_deadline_s == 3 * alone_sim.engine.cfg.report_deadline_s == 3 * 300.0
    )
    assert together_sim.cfg.report_deadline_s == 300.0  # the caller's config is left as it was
    assert alone["rounds_completed"] == together["rounds_completed"] == 2
    assert together["uploads_confirmed"] == alone["uploads_confirmed"] == 6
    assert together["best_valid"] == pytest.approx(alone["best_valid"], rel=1e-4)
    assert together["test"] == pytest.approx(alone["test"], rel=1e-4)
    assert together["best_valid"] < 0.5 * len(task.vocab)  # it trained: far below a uniform guess


def test_a_cohort_goes_on_without_agents_that_go_offline_or_crash(tmp_path):
    """Agents that go offline or crash in training leave the cohort without holding it up: every round closes,
    and a cohort trains only the agents that handed in their jobs."""
    task = make_task(
        "lm",
        data="builtin",
        model="gru-tiny",
        emb=16,
        hidden=16,
        clients=8,
        vocab_size=300,
        max_lines=800,
        max_eval_lines=100,
        seed=0,
    )
    cfg = JobConfig(
        job="cohort-faults",
        strategy="fedavg",
        rounds=3,
        clients=8,
        fraction=1.0,
        lr=0.5,
        momentum=0.5,
        batch_size=4,
        epochs=1,
        max_steps=3,
        clip=0.0,
        heartbeat_s=1.0,
        seed=1,
        report_deadline_s=0.5,
        update_deadline_s=4.0,
    )  # report: 8 × 0.5 s for the cohort
    sim = Simulation(
        cfg,
        task,
        "memory://cohort-faults",
        run_dir=tmp_path / "run",
        cohort=True,
        availability="bernoulli:0.8",
        faults="crash-train:0.2",
        rejoin_s=0.2,
    )
    summary = sim.run()
    lost = sum(
        len(log.offline_rounds) + sum(1 for _, f in log.faults if f == "crash-train")
        for log in sim.agent_logs.values()
    )
    trained = sum(len(log.rounds_trained) for log in sim.agent_logs.values())
    assert summary["rounds_completed"] == 3 and lost > 0
    assert sum(sim.pool.cohorts) == trained == summary["uploads_confirmed"] < 3 * 8
