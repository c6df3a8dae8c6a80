"""Rounds cost what the selected clients cost (issue: publish each global model once, only selected agents
fetch it, simulated clients without per-client model copies), end to end over the in-process broker; and what
the round's config tells the selected agents reaches their local training."""

from __future__ import annotations

import time

import pytest
import torch

from fedmq.aggregator.config import JobConfig
from fedmq.broker.wire import messages
from fedmq.client_agent.state import DiskStore, MemoryStore
from fedmq.client_agent.trainers import TrainerPool
from fedmq.errors import CodecError
from fedmq.tasks.lm import LanguageModelTask


class CountingTask(LanguageModelTask):
    built = 0

    def build_model(self, seed: int = 0):
        CountingTask.built += 1
        return super().build_model(seed)


@pytest.fixture(scope="module")
def task(tiny_lm):
    return tiny_lm(8, CountingTask)


def _cfg(job: str, **kw) -> JobConfig:
    base = dict(
        job=job,
        encoding="raw",
        down_encoding="raw",
        strategy="fedavg",
        rounds=3,
        clients=8,
        fraction=0.25,
        lr=5.0,
        max_steps=2,
        batch_size=4,
        heartbeat_s=0.5,
        join_timeout_s=20,
        report_deadline_s=60,
        update_deadline_s=30,
    )
    return JobConfig(**{**base, **kw})


def test_only_selected_agents_fetch_and_one_trainer_serves_all(federation, task, tmp_path, monkeypatch):
    from fedmq.broker.transport.memory import MemoryBroker

    keys: list[str] = []
    publish = MemoryBroker.publish

    def spy(self, routing_key, body, **kw):
        keys.append(routing_key)
        return publish(self, routing_key, body, **kw)

    monkeypatch.setattr(MemoryBroker, "publish", spy)
    CountingTask.built = 0
    pool = TrainerPool(task, 1, 0)
    engine, agents, summary = federation(
        task, _cfg("cost"), "memory://cost", tmp_path / "run", trainers=pool, keep_sent=True
    )
    announced = sorted(k.rsplit(".", 1)[1] for k in keys if k.startswith("job.cost.announce."))
    assert announced == sorted(c for r in engine.runlog.rows() for c in r.selected)  # to the selected only
    assert "job.cost.global" not in keys and keys.count("job.cost.model") == 3  # one model message a version
    assert summary["rounds_completed"] == 3
    # the pool's one trainer, the engine's model and the throwaway models groups() builds: none per agent
    assert CountingTask.built < 8
    rows = engine.runlog.rows()
    selected = {c for r in rows for c in r.selected}
    for a in agents:
        fetched = a.log.fetched_bytes
        assert (fetched > 0) == (a.client in selected), (a.client, fetched)
    model_bytes = sum(a.log.fetched_bytes for a in agents)
    down = sum(r.bytes_down for r in rows)
    # what the engine counts down: the models the selected agents read plus 3 small announces to 8 agents
    assert model_bytes <= down <= model_bytes + 3 * 8 * 2000
    assert all(r.bytes_down < 2 * 2.2 * max(r.bytes_up / len(r.received), 1) for r in rows)


def test_delta_pushes_with_keyframes_stay_exact(federation, task, tmp_path):
    """Everyone selected every round: agents holding v−1 fetch the (exact, XOR) raw delta, except at keyframes
    (every 2nd version here), and the aggregate is still FedAvg of exactly what was sent."""
    from fedmq.client_agent.agent import Agent

    forms: dict[int, set[int]] = {}

    class Recording(Agent):
        def _read_model(self, broker, entry, version):
            menv = super()._read_model(broker, entry, version)
            forms.setdefault(version, set()).add(menv.payload["base_version"])
            return menv

    cfg = _cfg("delta", clients=3, fraction=1.0, rounds=4, down_encoding="delta+raw", keyframe_every=2)
    engine, agents, summary = federation(
        task, cfg, "memory://delta", tmp_path / "run", keep_sent=True, agent_class=lambda i: Recording
    )
    assert summary["rounds_completed"] == 4
    assert forms == {0: {-1}, 1: {0}, 2: {-1}, 3: {2}}
    sent = [a.log.sent[4] for a in agents]
    total = sum(n for n, _ in sent)
    for name in sent[0][1]:
        expected = sum(n * t[name].double() for n, t in sent) / total
        torch.testing.assert_close(engine.global_state[name].double(), expected, rtol=1e-5, atol=1e-6)


def test_announce_model_entries_are_validated():
    env = messages.announce(
        "j",
        1,
        0,
        ["a"],
        JobConfig().round_config(),
        [{"id": "m", "base_version": -1, "partial": False, "since": 1.0, "bytes": 10}],
    )
    assert messages.decode(messages.encode(env)).payload["models"][0]["id"] == "m"
    for bad in (
        {"id": "m"},
        {"id": 3, "base_version": -1, "partial": False, "since": 1.0, "bytes": 1},
        {"id": "m", "base_version": -1, "partial": 1, "since": 1.0, "bytes": 1},
        {"id": "m", "base_version": -1, "partial": False, "since": float("nan"), "bytes": 1},
    ):
        with pytest.raises(CodecError, match="announce models"):
            messages.encode(messages.announce("j", 1, 0, ["a"], JobConfig().round_config(), [bad]))


@pytest.mark.parametrize("store_kind", ["memory", "disk"])
def test_state_stores_round_trip(tmp_path, store_kind):
    store = MemoryStore() if store_kind == "memory" else DiskStore(tmp_path / "clients")
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    assert store.get("a", "model") is None
    store.put("a", "model", 4, state)
    version, got = store.get("a", "model")
    assert version == 4 and torch.equal(got["w"], state["w"])
    if store_kind == "disk":  # a client's model, trained on its private data: the owner's alone
        assert [p.stat().st_mode & 0o777 for p in (tmp_path / "clients").iterdir()] == [0o600]
    store.drop("a", "model")
    assert store.get("a", "model") is None


def test_a_model_published_before_its_announced_time_is_still_found(task, monkeypatch):
    """Clock skew: the announce says the model was published later than the stream's clock says. The agent's
    read from that time misses it, then reads the (short) stream from its start."""
    import time

    from fedmq.broker.transport import topology as t
    from fedmq.broker.transport.connect import connect
    from fedmq.broker.wire.encodings import EncodingSpec, encode_state
    from fedmq.client_agent import agent as agent_mod

    monkeypatch.setattr(agent_mod, "FIRST_TRY_S", 0.5)
    pool = TrainerPool(task, 1, 0)
    agg = connect("memory://skew", user="fedmq-aggregator")
    agg.declare_job("skew", ["agent-0"], model_bytes=pool.manifest.message_bound)
    state = {k: v.detach() for k, v in pool.task.build_model(0).named_parameters()}
    env = messages.model("skew", 0, encode_state(state, EncodingSpec()))
    body = messages.encode(env)
    agg.publish(t.rk_model("skew"), body, message_id=env.msg_id)
    a = agent_mod.Agent(
        lambda: connect("memory://skew", user="agent-0"), "skew", "agent-0", 0, task, trainers=pool
    )
    b = connect("memory://skew", user="agent-0")
    try:
        entry = messages.model_entry(env, time.time() + 3600, len(body))  # "published" an hour from now
        got = a._read_model(b, entry, 0)
        assert got.msg_id == env.msg_id and a.log.fetched_bytes == len(body)
    finally:
        b.close()
        agg.close()


def _feedback_run(federation, task, tmp_path, name: str, **kw):
    """Three clients, every one selected every round, top-5 % deltas up, raw down;
    records what each agent kept."""
    from fedmq.client_agent.agent import Agent
    from fedmq.upload_hooks import ErrorFeedback

    seen: dict[str, list[dict]] = {}

    class Recording(Agent):
        def _client_hooks(self, spec, version):
            hooks = super()._client_hooks(spec, version)
            for hook, _ in hooks:
                if isinstance(hook, ErrorFeedback):
                    hook.sent = self._recorded(hook, hook.sent)
            return hooks

        def _recorded(self, hook, plain):
            def sent(update, kept):
                held, before = hook.context.held, hook._residual
                plain(update, kept)
                seen.setdefault(self.client, []).append(
                    {
                        "upload_delta": {k: (v - held[k]).clone() for k, v in hook._upload.items()},
                        "before": None if before is None else {k: t.clone() for k, t in before.items()},
                        "after": {k: t.clone() for k, t in kept.get("residual").items()},
                        "sent": {k: v.clone() for k, v in update.items()},
                    }
                )

            return sent

    cfg = _cfg(name, clients=3, fraction=1.0, rounds=4, encoding="delta+topk:0.05", **kw)
    engine, agents, summary = federation(
        task, cfg, f"memory://{name}", tmp_path / name, agent_class=lambda i: Recording
    )
    assert summary["rounds_completed"] == 4
    return engine, agents, seen


def test_error_feedback_delays_what_topk_leaves_out_and_loses_nothing(federation, task, tmp_path):
    engine, agents, seen = _feedback_run(federation, task, tmp_path, "ef")
    assert set(seen) == {a.client for a in agents} and all(len(v) == 4 for v in seen.values())
    for rounds in seen.values():
        for i, r in enumerate(rounds):
            for k, up in r["upload_delta"].items():
                # nothing is lost: what the aggregator decodes plus what is kept is exactly what was to be
                # sent
                torch.testing.assert_close(r["sent"][k] + r["after"][k], up, rtol=0, atol=1e-6)
                # top-k keeps 5 %: most of the change waits in the residual
                assert int((r["sent"][k] != 0).sum()) <= max(1, int(0.05 * up.numel()) + 1)
            if i:  # the previous round's leftover rides on this upload (and the store kept it between rounds)
                assert r["before"] is not None
                for k in r["before"]:
                    torch.testing.assert_close(r["before"][k], rounds[i - 1]["after"][k], rtol=0, atol=0)
            else:
                assert r["before"] is None


def test_error_feedback_brings_topk_closer_to_raw_and_off_keeps_nothing(federation, task, tmp_path):
    raw_engine, _, _ = federation(
        task, _cfg("efraw", clients=3, fraction=1.0, rounds=4), "memory://efraw", tmp_path / "raw"
    )
    on_engine, _, _ = _feedback_run(federation, task, tmp_path, "efon")
    off_engine, off_agents, off_seen = _feedback_run(
        federation, task, tmp_path, "efoff", error_feedback=False
    )
    assert off_seen == {} and all(
        a.store.get(a.client, "hook.error-feedback.residual") is None for a in off_agents
    )

    def gap(engine) -> float:
        return (
            sum(
                float((engine.global_state[k] - raw_engine.global_state[k]).double().norm() ** 2)
                for k in raw_engine.global_state
            )
            ** 0.5
        )

    assert gap(on_engine) < gap(off_engine)


def test_error_feedback_is_a_boolean_and_only_for_sparsified_deltas():
    from fedmq.aggregator.config import JobConfigError

    with pytest.raises(JobConfigError, match="error_feedback must be true or false"):
        JobConfig(error_feedback="yes")
    from fedmq.aggregator.strategies.registry import client_hooks
    from fedmq.upload_hooks import ErrorFeedback

    def feedback(**settings) -> bool:
        return (ErrorFeedback, {}) in client_hooks(JobConfig(**settings))

    assert feedback(encoding="delta+topk:0.05")
    assert not feedback(encoding="delta+topk:0.05", error_feedback=False)
    # quantised, not sparsified; and topk of the weights, not of a change
    assert not feedback(encoding="delta+int8") and not feedback(encoding="topk:0.05")


def test_mixed_precision_reaches_local_training_and_the_cpu_ignores_it(federation, task, tmp_path):
    """``amp`` travels in the round config to every agent's TrainConfig; on the CPU it changes no number."""
    from fedmq.client_agent.agent import Agent

    asked: list[bool] = []

    class Recording(Agent):
        def _train(self, model, held, cfg, rnd, crash, **hook):
            asked.append(cfg.train.amp)
            return super()._train(model, held, cfg, rnd, crash, **hook)

    runs = {}
    for amp in (False, True):
        cfg = _cfg(f"amp{int(amp)}", clients=3, fraction=1.0, rounds=2, amp=amp)
        runs[amp], _, _ = federation(
            task, cfg, f"memory://amp{int(amp)}", tmp_path / str(amp), agent_class=lambda i: Recording
        )
    assert asked == [False] * 6 + [True] * 6
    assert JobConfig(amp=True).train_config().amp and not JobConfig().train_config().amp
    for k, v in runs[False].global_state.items():
        assert torch.equal(v, runs[True].global_state[k])


def test_mixed_precision_is_a_boolean_in_the_job_and_on_the_wire():
    from fedmq.aggregator.config import JobConfigError

    with pytest.raises(JobConfigError, match="amp must be true or false"):
        JobConfig(amp="yes")
    payload = JobConfig().round_config().to_payload()
    payload["train"]["amp"] = 1
    with pytest.raises(CodecError, match="train amp must be bool"):
        messages.RoundConfig.from_payload(payload)


def test_annealing_divides_the_clients_lr_after_each_round_that_did_not_improve(federation, task, tmp_path):
    """``lr_anneal``: the lr announced for round r+1 is round r's ÷ lr_anneal exactly when round r's
    validation was no better than the best before it, and the factor survives a restart (checkpoint)."""
    from fedmq.aggregator.checkpoint import load_checkpoint
    from fedmq.client_agent.agent import Agent

    lrs: dict[int, float] = {}

    class Recording(Agent):
        def _train(self, model, held, cfg, rnd, crash, **hook):
            lrs[rnd] = cfg.train.lr
            return super()._train(model, held, cfg, rnd, crash, **hook)

    # lr 200 without clipping overshoots after the first round: validation stops improving
    cfg = _cfg("anneal", clients=2, fraction=1.0, rounds=4, lr=200.0, clip=0.0, lr_anneal=4.0)
    engine, _, summary = federation(
        task, cfg, "memory://anneal", tmp_path / "run", agent_class=lambda i: Recording
    )
    assert summary["rounds_completed"] == 4
    valid = [row.valid for row in engine.runlog.rows()]
    expected, best = [200.0], None
    for score in valid[:2]:
        improved = best is None or score < best
        expected.append(expected[-1] if improved else expected[-1] / 4)
        best = score if improved else best
    assert [lrs[r] for r in (1, 2, 3)] == expected and expected[-1] < 200.0
    saved = load_checkpoint(tmp_path / "run" / "checkpoints")
    assert saved.extra["lr_scale"] == engine.lr_scale < 1.0
    with pytest.raises(Exception, match=r"lr_anneal \(--lr-anneal\) must be in \[1, 1000\]"):
        JobConfig(lr_anneal=0.5)


def test_agents_share_the_decode_of_a_full_model_but_not_of_a_delta_onto_their_own_base(task):
    """Two agents of one process read version 2: the full form is decoded once and shared; a delta is
    decoded onto each agent's own kept version 1; a delta whose message says another base than the announce
    (and than what the agent keeps) is refused, not decoded onto the wrong base."""
    from fedmq.broker.transport import topology as t
    from fedmq.broker.transport.connect import connect
    from fedmq.broker.wire.encodings import EncodingSpec, encode_state
    from fedmq.client_agent.agent import Agent

    pool, store = TrainerPool(task, 1, 0), MemoryStore()
    agg = connect("memory://share", user="fedmq-aggregator")
    agg.declare_job("share", ["agent-0", "agent-1"], model_bytes=pool.manifest.message_bound)
    v2 = {k: v.detach().clone() for k, v in pool.task.build_model(0).named_parameters()}
    v1 = {k: v - 0.25 for k, v in v2.items()}
    delta = encode_state(v2, EncodingSpec.parse("delta+raw"), v1)
    published = {}
    for form, env in {
        "full": messages.model("share", 2, encode_state(v2, EncodingSpec())),
        "delta": messages.model("share", 2, delta, base_version=1),
        "forged": messages.model("share", 2, delta, base_version=0),
    }.items():
        body = messages.encode(env)
        since = time.time()
        agg.publish(t.rk_model("share"), body, message_id=env.msg_id)
        published[form] = messages.model_entry(env, since, len(body))
    published["forged"] = {**published["forged"], "base_version": 1}  # the announce claims the kept base
    agents = []
    for i in range(2):
        client = f"agent-{i}"
        store.put(client, "model", 1, {k: v.clone() for k, v in v1.items()})
        agent = Agent(lambda: None, "share", client, i, task, trainers=pool, store=store)
        agent._broker = connect("memory://share", user=client)  # joined: a connection, no loop of its own
        agents.append(agent)
    config = JobConfig().round_config(1, 1.0)

    def fetch(agent, form):
        env = messages.announce("share", 1, 2, ["agent-0", "agent-1"], config, [published[form]])
        return agent._fetch_model(env)

    try:
        with pool.ahead():
            full = [fetch(a, "full") for a in agents]
            assert all(full[0][k].data_ptr() == full[1][k].data_ptr() for k in v2)  # one decode, shared
            assert all(torch.equal(full[0][k], v2[k]) for k in v2)
            deltas = [fetch(a, "delta") for a in agents]
            assert all(deltas[0][k].data_ptr() != deltas[1][k].data_ptr() for k in v2)  # each its own
            assert all(torch.allclose(deltas[1][k], v2[k], atol=1e-6) for k in v2)
            assert [fetch(a, "forged") for a in agents] == [None, None]  # refused: sits the round out
    finally:
        for a in agents:
            a._broker.close()
        agg.close()
