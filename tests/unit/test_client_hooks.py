"""Client hooks (fedmq.hooks): what an announcement may ask of an agent, what the agent refuses with one line,
and the gradient terms a hook adds to any task's training loop."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fedmq.broker.wire import messages
from fedmq.broker.wire.envelope import pack
from fedmq.client_agent.agent import Agent, ClientHookError
from fedmq.errors import CodecError
from fedmq.hooks import PROTOCOL, ClientHook, install_gradient_terms
from fedmq.train_config import TrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "docs" / "examples"))
from logreg import LogReg  # noqa: E402

PROX = "fedmq.aggregator.strategies.fedprox:ProxHook"


def _agent(strategy: str = "fedprox") -> Agent:
    return Agent(lambda: None, "job", "agent-0", 0, LogReg(clients=2), strategy=strategy)


def _map(hook: str = PROX, version: int = PROTOCOL, **over) -> dict:
    entry = {"hook": hook, "hook_version": 1, "args": {"mu": 0.1}, **over}
    return {"version": version, "hooks": [entry]}


def test_an_agent_builds_fedmqs_own_hook_with_the_announced_arguments():
    [(hook, kept)] = _agent()._client_hooks(_map(), 3)
    assert type(hook).__name__ == "ProxHook" and hook.mu == 0.1
    assert _agent()._client_hooks(None, 3) == [] and _agent()._client_hooks({}, 3) == []


@pytest.mark.parametrize(
    ("spec", "strategy", "words"),
    [
        (_map("os.path:Hook"), "fedprox", "client hook 'os.path:Hook', which this agent may not import"),
        (
            _map("mine_evil:Hook"),
            "mine:Strategy",
            "which this agent may not import",
        ),  # not the strategy's module
        (_map(version=PROTOCOL + 1), "fedprox", f"client-map version {PROTOCOL + 1}; this agent reads up to"),
        (_map(hook_version=7), "fedprox", "the job runs version 7, this agent has 1"),
    ],
)
def test_what_an_agent_cannot_run_is_one_line(spec, strategy, words):
    with pytest.raises(ClientHookError, match=words.replace("(", r"\(").replace(")", r"\)")) as err:
        _agent(strategy)._client_hooks(spec, 3)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"mu": "big"}, "mu must be a number, got 'big'"),
        ({"nu": 1}, "has no parameter 'nu'"),
        ({"mu": -1.0}, "mu must be >= 0"),
    ],
)
def test_hook_arguments_the_aggregator_never_sends_are_a_damaged_announce(args, words):
    # the aggregator checked the job's arguments at start: the agent rejects the message, not the job
    with pytest.raises(CodecError, match=words) as err:
        _agent()._client_hooks(_map(args=args), 3)
    assert err.value.reason == "bad-payload" and "\n" not in str(err.value)


def test_the_strategys_own_module_may_provide_the_hook(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text(
        "import fedmq\nclass Hook(fedmq.ClientHook):\n"
        "    def __init__(self, mu: float = 0.0):\n        self.mu = mu\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _agent("mine:Strategy")._client_hooks(_map("mine:Hook"), 3)[0][0].mu == 0.1


def _round_config(**train) -> messages.RoundConfig:
    settings = {"epochs": 1, "batch_size": 4, "lr": 0.1, "clip": 0.0, "max_steps": 1, **train}
    return messages.RoundConfig(TrainConfig(**settings), encoding="raw", grant=False, keep_model=False)


def test_announcements_carry_a_checked_client_map_that_old_agents_can_ignore():
    cfg = _round_config()
    env = messages.announce("job", 1, 0, ["agent-0"], cfg, [], client={**_map(), "future": {"x": 1}})
    assert messages.decode(messages.encode(env)).payload["client"]["hooks"][0]["hook"] == PROX
    assert "client" not in messages.announce("job", 1, 0, ["agent-0"], cfg, []).payload
    bad_maps = (
        {"hooks": []},
        _map(hook="not a path"),
        _map(args=[1]),
        {"version": "1", "hooks": []},
        {"version": 2, "hooks": {"hook": PROX}},
        {"version": 2},
        {"version": 1, **_map()["hooks"][0]},
        {"version": 0, "hooks": []},
    )
    for bad in bad_maps:
        env = messages.announce("job", 1, 0, ["agent-0"], cfg, [])
        env.payload["client"] = bad
        with pytest.raises(CodecError, match="announce client must be"):
            messages.decode(_pack(env))
    # a newer map's shape is the agent's to refuse, in words (above), not a damaged message
    env = messages.announce("job", 1, 0, ["agent-0"], cfg, [], client={"version": PROTOCOL + 1, "plan": 1})
    assert messages.decode(messages.encode(env)).payload["client"]["version"] == PROTOCOL + 1


def test_the_training_settings_travel_whole_and_within_bounds():
    cfg = _round_config(warmup_steps=5, adam_betas=(0.8, 0.99), optimizer="adam")
    payload = cfg.to_payload()
    assert "device" not in payload["train"]
    assert messages.RoundConfig.from_payload(payload) == cfg
    # keys a newer aggregator adds are ignored, in the config and in its training settings
    newer = {**payload, "later": 1, "train": {**payload["train"], "later": True}}
    assert messages.RoundConfig.from_payload(newer) == cfg
    for field, value in [
        ("epochs", 10**9),
        ("lr", 1e300),
        ("batch_size", 2**40),
        ("max_steps", -1),
        ("lr", 0.0),
        ("momentum", float("nan")),
        ("adam_betas", [0.9, 1.5]),
        ("epochs", 2.0),
        ("optimizer", "lbfgs"),
    ]:
        forged = {**payload, "train": {**payload["train"], field: value}}
        with pytest.raises(CodecError, match=f"announce config: train {field}"):
            messages.RoundConfig.from_payload(forged)
    lacking = {**payload, "train": {k: v for k, v in payload["train"].items() if k != "lr"}}
    with pytest.raises(CodecError, match="train lacks lr"):
        messages.RoundConfig.from_payload(lacking)


def test_a_job_asking_for_more_than_an_agent_trains_with_is_refused_at_once():
    from fedmq.aggregator.config import JobConfig, JobConfigError

    for field, value, words in [
        ("epochs", 5_000, r"epochs \(--epochs\) must be in \[1, 1000\]"),
        ("lr", 1e5, r"lr \(--lr\) must be in \(0, 10000\]"),
        ("batch_size", 2**20, r"batch_size \(--batch-size\) must be in"),
    ]:
        with pytest.raises(JobConfigError, match=words):
            JobConfig(**{field: value})


def _pack(env):
    return pack(env)


class _Pull(ClientHook):
    def __init__(self, mu: float) -> None:
        self.mu, self.start = mu, {}

    def gradient(self, name, param):
        return self.mu * (param - self.start[name])


def test_gradient_terms_are_added_at_every_step_and_removed_after():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    hook = _Pull(0.5)
    hook.start = {k: v.detach().clone() - 1.0 for k, v in model.state_dict().items()}  # w − w_start = 1
    x = torch.randn(4, 3)
    plain = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    remove = install_gradient_terms(model, hook)
    model.zero_grad()
    model(x).sum().backward()
    assert all(torch.allclose(p.grad, g + 0.5) for p, g in zip(model.parameters(), plain))
    remove()
    model.zero_grad()
    model(x).sum().backward()
    assert all(torch.allclose(p.grad, g) for p, g in zip(model.parameters(), plain))
    # a hook without gradient terms registers nothing
    assert install_gradient_terms(model, ClientHook())() is None


def test_cohort_training_refuses_a_strategy_with_a_client_hook(tmp_path):
    import fedmq

    cfg = fedmq.JobConfig(job="c", strategy="fedprox", rounds=1, clients=2, fraction=1.0, lr=0.5, max_steps=1)
    sim = fedmq.Simulation(cfg, LogReg(clients=2), run_dir=tmp_path / "run", cohort=True)
    with pytest.raises(fedmq.BadParameter, match="cannot run the client hook of strategy 'fedprox'"):
        sim.run()


def test_the_jobs_settings_choose_fedmqs_upload_hooks_after_the_strategys():
    from fedmq.aggregator.config import JobConfig
    from fedmq.aggregator.strategies.fedprox import ProxHook
    from fedmq.aggregator.strategies.registry import client_hooks, client_map
    from fedmq.upload_hooks import DynamicPulling, ErrorFeedback, Randomization

    assert client_hooks(JobConfig()) == [] and client_map(JobConfig()) == {}
    assert client_hooks(JobConfig(strategy="fedprox", noise=0.01, strategy_args={"mu": 0.2})) == [
        (ProxHook, {"mu": 0.2}),
        (Randomization, {"sigma": 0.01}),
    ]
    pulled = client_hooks(JobConfig(strategy="pull-global", pull_down=True, pull_fraction=0.33))
    assert pulled == [(DynamicPulling, {"mode": "global", "fraction": 0.33, "by": "params", "down": True})]
    assert client_hooks(JobConfig(encoding="delta+topk:0.05")) == [(ErrorFeedback, {})]
    assert client_hooks(JobConfig(encoding="delta+topk:0.05", error_feedback=False)) == []
    # each is announced by its import path, which every agent may import (it is fedmq's)
    spec = client_map(JobConfig(strategy="pull-local", noise=0.1))
    assert [h["hook"] for h in spec["hooks"]] == [
        "fedmq.upload_hooks:Randomization",
        "fedmq.upload_hooks:DynamicPulling",
    ]
    built = _agent()._client_hooks(spec, 1)
    assert [type(h).__name__ for h, _ in built] == ["Randomization", "DynamicPulling"]
    # only a hook that acts inside training keeps a job from batched cohort training
    assert ProxHook.changes_training() and not Randomization.changes_training()
    assert not DynamicPulling.changes_training() and ErrorFeedback.reads_what_is_sent()


def test_a_forged_announce_costs_the_agent_its_round_never_its_life():
    """A hook argument the aggregator would never send (fedmq's own noise hook with an infinite sigma): the
    agent logs the rejected announce and goes on serving; an older aggregator's flat config is named."""
    agent = _agent()
    spec = {
        "version": PROTOCOL,
        "hooks": [
            {"hook": "fedmq.upload_hooks:Randomization", "hook_version": 1, "args": {"sigma": float("inf")}}
        ],
    }
    with pytest.raises(CodecError, match="sigma must be finite"):
        agent._client_hooks(spec, 1)
    env = messages.announce("job", 1, 0, ["agent-0"], _round_config(), [], client=spec)
    agent._on_announce(messages.decode(messages.encode(env)))  # logged and skipped: no exception
    assert agent.log.rounds_trained == []
    old = {"epochs": 1, "lr": 0.1, "encoding": "raw", "grant": False, "keep_model": False}
    with pytest.raises(CodecError, match="older fedmq"):
        messages.RoundConfig.from_payload(old)


class _Constant(ClientHook):
    """A gradient term of 0.25 on every coordinate."""

    def gradient(self, name, param):
        return torch.full_like(param, 0.25)


@pytest.mark.parametrize("full_batch", [False, True], ids=["minibatch", "full-batch"])
def test_fedmqs_training_loop_adds_a_gradient_term_once_a_step(full_batch):
    """One SGD step over 4 batches: the term is added once to the step's gradient, whether the step is one
    batch's or the whole shard's (FedSGD's full-batch step sums a backward pass per batch)."""
    from fedmq.tasks.training import run_training

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    xs = [torch.randn(5, 3) for _ in range(4)]

    def epoch(m, gen, device):
        for x in xs:
            yield m(x).pow(2).mean(), len(x)

    start = [p.detach().clone() for p in model.parameters()]
    first = xs[:1] if not full_batch else xs
    grads = torch.autograd.grad(
        sum(model(x).pow(2).mean() * len(x) for x in first) / sum(len(x) for x in first),
        list(model.parameters()),
    )
    remove = install_gradient_terms(model, _Constant())
    cfg = TrainConfig(lr=1.0, momentum=0.0, clip=0.0, max_steps=1, full_batch=full_batch, optimizer="sgd")
    run_training(model, epoch, 4, cfg, client=0, n_samples=20)
    remove()
    for p, p0, g in zip(model.parameters(), start, grads):
        assert torch.allclose(p.detach(), p0 - (g + 0.25), atol=1e-6)


def test_scaffold_trains_a_round_again_from_the_control_variate_its_first_try_started_from():
    """A retrain from the same version (a resumed simulation) repeats the upload; a newer version starts from
    the c_i the last round computed."""
    from fedmq.aggregator.strategies.scaffold import PREFIX, ScaffoldHook
    from fedmq.client_agent.state import MemoryStore
    from fedmq.hooks import Kept
    from fedmq.tasks.base import TrainResult

    store, train = MemoryStore(), TrainConfig(lr=0.5)
    result = TrainResult(loss=1.0, n_samples=4, steps=2, tokens=4, seconds=0.0)

    def round_from(version: int, x: float, c: float) -> dict:
        kept = Kept(store, "agent-0", "hook.scaffold", version)
        hook = ScaffoldHook()
        hook.begin({"w": torch.full((2,), x), PREFIX + "w": torch.full((2,), c)}, train, kept)
        return hook.finish({"w": torch.full((2,), x - 0.25)}, result, kept)

    first = round_from(3, 1.0, 0.1)
    again = round_from(3, 1.0, 0.1)  # its kept c_i⁺ is the first try's, from the same version
    assert all(torch.equal(first[k], again[k]) for k in first)
    # c_i⁺ = c_i − c + (x − y)/(K·η) = 0 − 0.1 + 0.25/(2·0.5)
    assert torch.allclose(store.get("agent-0", "hook.scaffold.c")[1]["w"], torch.full((2,), 0.15))
    round_from(4, 1.0, 0.1)  # a newer version: from c_i = 0.15
    assert torch.allclose(store.get("agent-0", "hook.scaffold.c")[1]["w"], torch.full((2,), 0.3))


def test_a_parameter_only_the_client_hook_refuses_fails_the_job_before_it_starts(tmp_path):
    """The example strategy takes any max_norm; its client hook refuses a negative one. The aggregator builds
    every hook of the client map once, so the job fails at once with one line, before any agent trains."""
    import fedmq
    from fedmq.aggregator.strategies.registry import client_map
    from fedmq.errors import BadParameter

    cfg = fedmq.JobConfig(strategy="own_strategy:DecayingFedAvg", strategy_args={"max_norm": -0.5})
    with pytest.raises(BadParameter, match=r"own_strategy:ClipUpdate.*max_norm must be positive") as err:
        client_map(cfg)
    assert "\n" not in str(err.value)
    with pytest.raises(BadParameter, match="max_norm must be positive"):
        fedmq.Simulation(cfg, LogReg(clients=2), run_dir=tmp_path / "run").run()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_agent_with_the_client_dp_hook_of_before_stale_top_ups_refuses_a_dp_job(monkeypatch):
    """Version 2 of ClientDP tops a stale secure member's share up (ClientDP.weigh): a job announces it, and
    an agent whose hook is version 1 would leave that release short of noise, so it refuses in one line."""
    from fedmq.aggregator.config import JobConfig
    from fedmq.aggregator.strategies.registry import client_map
    from fedmq.privacy.client_dp import ClientDP

    spec = client_map(JobConfig(dp="client", secagg=True, strategy="async"))
    [entry] = [e for e in spec["hooks"] if e["hook"].endswith(":ClientDP")]
    assert entry["hook_version"] == ClientDP.version == 2
    monkeypatch.setattr(ClientDP, "version", 1)
    with pytest.raises(ClientHookError, match="the job runs version 2, this agent has 1"):
        _agent("async")._client_hooks(spec, 3)
