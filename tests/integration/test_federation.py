"""End-to-end rounds over the in-process broker and over real RabbitMQ with several agents and a tiny
model."""

from __future__ import annotations

import time

import pytest
import torch
from load_factor import budget

from fedmq.aggregator.config import JobConfig


@pytest.fixture(scope="module")
def task(tiny_lm):
    return tiny_lm(4)


def fedavg_of(sent):
    total = sum(n for n, _ in sent)
    names = sent[0][1].keys()
    return {k: sum(n * t[k].double() for n, t in sent) / total for k in names}


def check_last_round_is_fedavg(engine, agents, rnd):
    sent = [
        a.log.sent[rnd]
        for a in agents
        if rnd in a.log.sent and any((rnd, u) in a.log.uploads for u in engine.folded[rnd])
    ]
    assert len(sent) == len(engine.folded[rnd]) > 0
    expected = fedavg_of(sent)
    for name, value in expected.items():
        torch.testing.assert_close(engine.global_state[name].double(), value, rtol=1e-5, atol=1e-6)


def test_fedavg_rounds_in_memory(federation, task, tmp_path):
    cfg = JobConfig(
        encoding="raw",
        down_encoding="raw",
        job="e2e",
        strategy="fedavg",
        rounds=3,
        clients=4,
        fraction=0.5,
        lr=5.0,
        max_steps=5,
        batch_size=4,
        heartbeat_s=0.5,
        join_timeout_s=20,
        report_deadline_s=60,
        update_deadline_s=30,
    )
    engine, agents, summary = federation(task, cfg, "memory://e2e-fedavg", tmp_path / "run", keep_sent=True)
    assert summary["rounds_completed"] == 3 and summary["rounds_skipped"] == 0
    assert engine.version == 3
    check_last_round_is_fedavg(engine, agents, 3)
    rows = engine.runlog.rows()
    assert [r.round for r in rows] == [1, 2, 3]
    assert all(len(r.received) == 2 for r in rows)  # m = C*K = 2 selected and folded each round
    assert rows[-1].valid < rows[0].valid * 1.5
    assert summary["test"] is not None and summary["test"] > 1
    assert (tmp_path / "run" / "summary.json").is_file() and (tmp_path / "run" / "config.json").is_file()


def test_fedmed_topk_grants_lowest_losses(federation, task, tmp_path):
    cfg = JobConfig(
        encoding="raw",
        down_encoding="raw",
        job="e2emed",
        strategy="fedmed",
        rounds=2,
        clients=4,
        fraction=1.0,
        beta=0.5,
        lr=5.0,
        max_steps=3,
        batch_size=4,
        heartbeat_s=0.5,
        join_timeout_s=20,
        report_deadline_s=60,
        update_deadline_s=30,
    )
    engine, agents, summary = federation(task, cfg, "memory://e2e-fedmed", tmp_path / "run", keep_sent=True)
    rows = engine.runlog.rows()
    assert summary["rounds_completed"] == 2
    for row in rows:
        assert len(row.granted) == 2 and row.received == tuple(sorted(row.granted))
        lowest = sorted(row.losses, key=lambda c: (row.losses[c], c))[:2]
        assert sorted(row.granted) == sorted(lowest)
    # the first round always uses the adaptive aggregation (no previous loss)
    assert rows[0].strategy == "fedmed"


def test_dead_agents_do_not_hang_a_round(federation, task, tmp_path):
    """Agents that crash during training: the round closes at its deadline,
    as skipped when below the minimum."""
    from fedmq.client_agent.availability import parse_faults

    cfg = JobConfig(
        encoding="raw",
        down_encoding="raw",
        job="e2edead",
        strategy="fedavg",
        rounds=1,
        clients=2,
        fraction=1.0,
        min_clients=1,
        lr=5.0,
        max_steps=2,
        batch_size=4,
        heartbeat_s=0.5,
        join_timeout_s=20,
        report_deadline_s=3,
        update_deadline_s=2,
    )
    engine, agents, summary = federation(
        task,
        cfg,
        "memory://e2e-dead",
        tmp_path / "run",
        keep_sent=True,
        faults=parse_faults("crash-train:1.0"),
    )
    row = engine.runlog.rows()[0]
    assert row.skipped and row.received == () and row.wall_s < 10
    assert engine.version == 0


@pytest.mark.rabbitmq
def test_fedavg_rounds_over_rabbitmq(federation, task, tmp_path, rabbit_url, job_id):
    cfg = JobConfig(
        encoding="raw",
        down_encoding="raw",
        job=job_id,
        strategy="fedavg",
        rounds=2,
        clients=3,
        fraction=1.0,
        lr=5.0,
        max_steps=3,
        batch_size=4,
        heartbeat_s=0.5,
        join_timeout_s=30,
        report_deadline_s=60,
        update_deadline_s=30,
        identity="shared:guest",
    )
    engine, agents, summary = federation(task, cfg, rabbit_url, tmp_path / "run", keep_sent=True)
    assert summary["rounds_completed"] == 2
    check_last_round_is_fedavg(engine, agents, 2)
    from fedmq.broker.transport import provision

    provision.purge(rabbit_url, job_id)


def test_round_closes_early_when_selected_agents_go_offline(federation, task, tmp_path):
    """An agent that leaves (availability model) says so; the round does not wait for its deadline."""
    from fedmq.client_agent.availability import parse_availability

    cfg = JobConfig(
        encoding="raw",
        down_encoding="raw",
        job="e2eoff",
        strategy="fedavg",
        rounds=2,
        clients=4,
        fraction=1.0,
        lr=5.0,
        max_steps=2,
        batch_size=4,
        heartbeat_s=0.5,
        join_timeout_s=20,
        report_deadline_s=60,
        update_deadline_s=60,
    )
    engine, agents, summary = federation(
        task,
        cfg,
        "memory://e2e-off",
        tmp_path / "run",
        keep_sent=True,
        availability=parse_availability("bernoulli:0.5", seed=3),
    )
    rows = engine.runlog.rows()
    assert summary["rounds_completed"] + summary["rounds_skipped"] == 2
    assert any(r.dropped for r in rows)  # someone was selected and left
    assert all(r.wall_s < 30 for r in rows)  # far below the 60 s deadlines


def test_dynamic_pulling_in_both_directions(federation, task, tmp_path):
    """--pull-down: after the first round the server pushes only the tensors its rule picks (by their change
    since the previous global), and each agent trains from those plus its own values for the rest."""
    from fedmq.client_agent.agent import Agent

    seen: dict[str, list] = {}

    class Recording(Agent):
        def _read_model(self, broker, entry, version):
            menv = super()._read_model(broker, entry, version)
            self.names = [rec["n"] for rec in menv.payload["tensors"]["t"]]
            return menv

        def _fetch_model(self, env, manifest=None, own=None):
            out = super()._fetch_model(env, manifest, own)
            own = None if own is None else {k: v.clone() for k, v in own.items()}
            if out is not None:
                seen.setdefault(self.client, []).append(
                    (env.round, self.names, own, {k: v.clone() for k, v in out.items()})
                )
            return out

    cfg = JobConfig(
        encoding="raw",
        down_encoding="raw",
        job="e2epush",
        strategy="pull-global",
        pull_fraction=0.5,
        pull_down=True,
        rounds=3,
        clients=3,
        fraction=1.0,
        lr=5.0,
        max_steps=2,
        batch_size=4,
        heartbeat_s=0.5,
        join_timeout_s=20,
        report_deadline_s=60,
        update_deadline_s=30,
    )
    engine, agents, summary = federation(
        task, cfg, "memory://e2e-push", tmp_path / "run", agent_class=lambda i: Recording
    )
    assert summary["rounds_completed"] == 3
    rows = engine.runlog.rows()
    assert rows[1].bytes_down_raw < rows[0].bytes_down_raw and rows[2].bytes_down_raw < rows[0].bytes_down_raw
    every = set(engine.manifest.names)
    for rnd in (2, 3):
        pushes = [
            (names, own, held) for records in seen.values() for r, names, own, held in records if r == rnd
        ]
        assert len(pushes) == 3
        names = pushes[0][0]
        assert 0 < len(names) < len(every) and all(p[0] == names for p in pushes)  # one push, a strict subset
        for _, own, held in pushes:
            for k in every - set(names):
                assert torch.equal(held[k], own[k])  # kept its own value
            for k in names:
                assert torch.equal(held[k], pushes[0][2][k])  # the same pushed global for everyone
        assert any(not torch.equal(pushes[0][2][k], pushes[0][1][k]) for k in names)


def test_pull_down_config_errors():
    with pytest.raises(Exception, match="needs a dynamic-pulling strategy"):
        JobConfig(strategy="fedavg", pull_down=True)
    with pytest.raises(Exception, match="cannot be deltas"):
        JobConfig(strategy="pull-local", pull_down=True, encoding="delta+int8")


def test_selection_counts_every_queued_heartbeat(task, tmp_path):
    """Heartbeats that queued while the aggregator was busy all count: selection samples from every live
    agent, not from the first few read (which made the seeded sampling a no-op in the experiments)."""
    from fedmq.aggregator.engine import Engine
    from fedmq.broker.transport import topology
    from fedmq.broker.transport.connect import connect
    from fedmq.broker.wire import messages

    url = "memory://e2e-presence"
    cfg = JobConfig(
        encoding="raw", down_encoding="raw", job="e2epres", clients=10, fraction=0.2, heartbeat_s=0.5
    )
    broker = connect(url, user=topology.AGGREGATOR_USER)
    engine = Engine(broker, task, cfg, tmp_path / "run", durable=False, evaluate=False)
    broker.declare_job(cfg.job, [])
    engine.inbox.subscribe(topology.q_inbox(cfg.job), prefetch=64)  # as Engine.run does
    for i in range(10):
        agent = connect(url, user=f"agent-{i}")
        env = messages.presence(cfg.job, f"agent-{i}", "online", 0)
        agent.publish(
            topology.rk_presence(cfg.job, f"agent-{i}"), messages.encode(env), message_id=env.msg_id
        )
    deadline = time.time() + budget(10)
    while engine.inbox.backlog() < 10 and time.time() < deadline:  # all ten queued, none read yet
        time.sleep(0.05)
    engine.wait_for_agents(cfg.selected_count(), 3 * cfg.heartbeat_s)
    assert len(engine.online()) == 10  # not just the 2 it needs
    broker.close()


def test_upload_only_pulling_keeps_unsent_tensors_private(federation, task, tmp_path):
    """Dynamic pulling upwards only (Passban et al.: unsent tensors are "protected from external updates and
    only modified using local data"): a DP_l client starts round 3 from the global model for the tensors it
    sent in round 2 and from its own trained values for the rest (in round 1, with no previous model,
    it sends all)."""
    from fedmq.client_agent.agent import Agent

    starts: dict[str, dict[int, dict]] = {}
    trained: dict[str, dict[int, dict]] = {}
    fetched: dict[str, dict[int, dict]] = {}

    class Recording(Agent):
        def _fetch_model(self, env, manifest=None, own=None):
            out = super()._fetch_model(env, manifest, own)
            if out is not None:
                fetched.setdefault(self.client, {})[env.round] = {k: v.clone() for k, v in out.items()}
            return out

        def _train(self, model, held, cfg, rnd, crash, **hook):
            starts.setdefault(self.client, {})[rnd] = {k: v.clone() for k, v in held.items()}
            result = super()._train(model, held, cfg, rnd, crash, **hook)
            trained.setdefault(self.client, {})[rnd] = {
                k: v.detach().clone() for k, v in model.state_dict().items()
            }
            return result

    cfg = JobConfig(
        encoding="raw",
        down_encoding="raw",
        job="e2eprivate",
        strategy="pull-local",
        rounds=3,
        clients=2,
        fraction=1.0,
        lr=5.0,
        max_steps=2,
        batch_size=4,
        heartbeat_s=0.5,
        join_timeout_s=20,
        report_deadline_s=60,
        update_deadline_s=30,
    )
    engine, agents, summary = federation(
        task, cfg, "memory://e2e-private", tmp_path / "run", keep_sent=True, agent_class=lambda i: Recording
    )
    assert summary["rounds_completed"] == 3
    for agent in agents:
        sent_r1 = set(agent.log.sent[2][1])
        start, global_v1 = starts[agent.client][3], fetched[agent.client][3]
        private = set(start) - sent_r1
        assert private and sent_r1, "DP_l sends part of the model and keeps the rest"
        for k in private:
            assert torch.equal(start[k], trained[agent.client][2][k]), k  # its own value, not the server's
            assert not torch.equal(start[k], global_v1[k]), k
        for k in sent_r1:
            assert torch.equal(start[k], global_v1[k]), k  # what it shared starts from the global model


def test_a_checkpoint_that_fails_to_write_ends_the_run_and_a_resume_replays_its_round(
    federation, task, tmp_path, monkeypatch
):
    """A round's checkpoint is written while the next round runs; one that cannot be written stops the run
    with its error when that next round closes. Both rounds' spools stay, and a resume replays them."""
    from fedmq.aggregator.checkpoint import PreparedCheckpoint, load_checkpoint

    real, written = PreparedCheckpoint.write, []

    def full_disk(self):
        if self.round == 3:  # the checkpoint after round 2
            raise OSError("No space left on device")
        written.append(self.round)
        return real(self)

    monkeypatch.setattr(PreparedCheckpoint, "write", full_disk)
    cfg = JobConfig(
        encoding="raw",
        down_encoding="raw",
        job="e2e-ckpt",
        rounds=3,
        clients=4,
        fraction=0.5,
        max_steps=2,
        batch_size=4,
        heartbeat_s=0.5,
        join_timeout_s=20,
    )
    run = tmp_path / "run"
    with pytest.raises(OSError, match="No space left"):
        federation(task, cfg, "memory://e2e-ckpt", run)
    assert written == [2] and load_checkpoint(run / "checkpoints").round == 2
    assert (run / "spool" / "r000002").is_dir() and (run / "spool" / "r000003").is_dir()
    monkeypatch.setattr(PreparedCheckpoint, "write", real)
    engine, _, summary = federation(task, cfg, "memory://e2e-ckpt", run)
    assert summary["rounds_completed"] == 3 and [r.round for r in engine.runlog.rows()] == [1, 2, 3]
    assert load_checkpoint(run / "checkpoints").round == 4 and not list((run / "spool").glob("r*"))
    assert not (run / "spool" / "free").exists()  # the cleared rounds' files, kept for reuse, go at the end
