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

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "docs" / "examples"))
from logreg import LogReg  # noqa: E402

PROX = "fedmq.aggregator.strategies.fedprox:ProxHook"


def _agent(strategy: str = "fedprox") -> Agent:
    return Agent(lambda: None, "job", "agent-0", 0, LogReg(clients=2), strategy=strategy)


def _map(hook: str = PROX, **over) -> dict:
    return {"version": PROTOCOL, "hook": hook, "hook_version": 1, "args": {"mu": 0.1}, **over}


def test_an_agent_builds_fedmqs_own_hook_with_the_announced_arguments():
    hook = _agent()._client_hook(_map())
    assert type(hook).__name__ == "ProxHook" and hook.mu == 0.1
    assert _agent()._client_hook(None) is None and _agent()._client_hook({}) is None


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
        (_map(args={"mu": "big"}), "fedprox", "mu must be a number, got 'big'"),
        (_map(args={"nu": 1}), "fedprox", "has no parameter 'nu'"),
        (_map(args={"mu": -1.0}), "fedprox", "mu must be >= 0"),
    ],
)
def test_what_an_agent_cannot_run_is_one_line(spec, strategy, words):
    with pytest.raises(ClientHookError, match=words.replace("(", r"\(").replace(")", r"\)")) as err:
        _agent(strategy)._client_hook(spec)
    assert "\n" not in str(err.value)


def test_the_strategys_own_module_may_provide_the_hook(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text(
        "import fedmq\nclass Hook(fedmq.ClientHook):\n"
        "    def __init__(self, mu: float = 0.0):\n        self.mu = mu\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _agent("mine:Strategy")._client_hook(_map("mine:Hook")).mu == 0.1


def test_announcements_carry_a_checked_client_map_that_old_agents_can_ignore():
    cfg = messages.RoundConfig(
        epochs=1,
        full_batch=False,
        batch_size=4,
        lr=0.1,
        optimizer="sgd",
        momentum=0.0,
        lr_decay=1.0,
        clip=0.0,
        max_steps=1,
        amp=False,
        tail_loss=False,
        seed=0,
        encoding="raw",
        noise=0.0,
        error_feedback=False,
        pull="all",
        pull_fraction=0.5,
        pull_by="params",
        pull_down=False,
        grant=False,
        keep_model=False,
        keep_own=False,
    )
    env = messages.announce("job", 1, 0, ["agent-0"], cfg, [], client={**_map(), "future": {"x": 1}})
    assert messages.decode(messages.encode(env)).payload["client"]["hook"] == PROX
    assert "client" not in messages.announce("job", 1, 0, ["agent-0"], cfg, []).payload
    for bad in ({"version": 1}, _map(hook="not a path"), _map(args=[1]), _map(version="1")):
        env = messages.announce("job", 1, 0, ["agent-0"], cfg, [])
        env.payload["client"] = bad
        with pytest.raises(CodecError, match="announce client must be"):
            messages.decode(
                messages.pack_unchecked(env) if hasattr(messages, "pack_unchecked") else _pack(env)
            )


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
