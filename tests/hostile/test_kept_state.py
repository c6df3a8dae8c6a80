"""In-process broker: state that outlives a round is checked before it is kept (fedmq.state_checks).

* FedAdam, a round the guard cannot judge (its norm rule off): one update of model + 1e20 left v = inf in the
  strategy state while the model stayed finite; every later step m / √v was zero and the job "trained" on at
  the same perplexity. Now the round is skipped, named, and the next honest round moves the model.
* SCAFFOLD, likewise: a control-variate change of 1e30 was kept as the server's c (5e29 with
  two clients); gradient norms overflowed, clipping zeroed every step. Now the round is skipped.
* An agent keeps no hook state that fails the check.
* A checkpoint with a valid digest but a strategy state of the wrong shape or type, or non-finite, is refused
  at restore in one line (CheckpointRefused), nothing resumed.
"""

from __future__ import annotations

import pytest
import torch
from quick_jobs import quick_job

from fedmq.aggregator.checkpoint import CheckpointRefused, load_checkpoint, save_checkpoint
from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.engine import Engine
from fedmq.aggregator.strategies.scaffold import PREFIX
from fedmq.broker.transport import topology
from fedmq.broker.transport.connect import connect
from fedmq.client_agent.agent import Agent
from fedmq.client_agent.state import MemoryStore
from fedmq.errors import CodecError
from fedmq.hooks import Kept
from fedmq.tasks.base import model_state


@pytest.fixture(scope="module")
def task(tiny_lm):
    return tiny_lm(2)


def _cfg(job: str, **kw) -> JobConfig:
    base = dict(
        rounds=3,
        clients=2,
        # the norm rule off: the round is one the guard cannot judge (with it on, a round of two with no
        # history drops an update moving the model by more than half its norm: these are dropped there)
        norm_bound_factor=0,
    )
    return quick_job(job, **{**base, **kw})


def _run(federation, task, tmp_path, cfg: JobConfig, hostile: type[Agent]):
    engine, _, summary = federation(
        task,
        cfg,
        f"memory://{cfg.job}",
        tmp_path / cfg.job,
        evaluate=False,
        agent_class=lambda i: hostile if i == 1 else Agent,
    )
    return engine, summary, engine.runlog.rows()


class HugeInRoundTwo(Agent):
    """Trains honestly, but its second upload is its model + 1e20 everywhere (finite, right shapes)."""

    uploads = 0

    def _trained_state(self, model):
        self.uploads += 1
        state = super()._trained_state(model)
        return {k: v + 1e20 for k, v in state.items()} if self.uploads == 2 else state


def _finite(state) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in state.values())


@pytest.mark.parametrize("strategy", ["fedadam", "fedyogi"])
def test_an_adaptive_optimizer_state_is_not_frozen_by_one_round(federation, task, tmp_path, strategy):
    engine, summary, rows = _run(
        federation, task, tmp_path, _cfg(f"kept-{strategy}", strategy=strategy), HugeInRoundTwo
    )
    assert [r.skipped for r in rows] == [False, True, False], [r.skip_reason for r in rows]
    assert "strategy state out of bounds" in rows[1].skip_reason and "agent-1" in rows[1].skip_reason
    kept = engine.strategy_state[strategy]
    assert _finite(kept["v"]) and _finite(kept["m"]) and kept["t"] == 2  # two steps taken, round 2 not one
    assert summary["version"] == 2 and _finite(engine.global_state)


class ForgedControlVariate(Agent):
    """Its first upload carries a control-variate change of 1e30 (what it keeps itself is honest)."""

    forged = False

    def _client_hooks(self, spec, version):
        hooks = super()._client_hooks(spec, version)
        for hook, _ in hooks:
            finish = hook.finish

            def forge(trained, result, kept, finish=finish):
                out = finish(trained, result, kept)
                if self.forged:
                    return out
                self.forged = True
                return {k: v + 1e30 if k.startswith(PREFIX) else v for k, v in out.items()}

            hook.finish = forge  # type: ignore[method-assign]
        return hooks


def test_a_huge_control_variate_change_is_not_kept(federation, task, tmp_path):
    before = model_state(task.build_model(0))
    engine, summary, rows = _run(
        federation, task, tmp_path, _cfg("kept-scaffold", strategy="scaffold", rounds=2), ForgedControlVariate
    )
    assert [r.skipped for r in rows] == [True, False], [r.skip_reason for r in rows]
    assert "aggregate out of bounds" in rows[0].skip_reason and PREFIX in rows[0].skip_reason
    c = {k: v for k, v in engine.global_state.items() if k.startswith(PREFIX)}
    assert c and max(float(v.abs().max()) for v in c.values()) < 1e3  # an honest round's c
    moved = [k for k, v in before.items() if not torch.equal(v.float(), engine.global_state[k])]
    assert moved and summary["version"] == 1  # the honest round trained the model


def test_an_agent_keeps_no_state_that_fails_the_check():
    store = MemoryStore()
    kept = Kept(store, "agent-0", "hook.scaffold", 3)
    for bad in (torch.tensor([1.0, float("inf")]), torch.full((4,), 1e30), torch.tensor([1, 2])):
        with pytest.raises(CodecError, match="hook.scaffold.c not kept"):
            kept.put("c", {"w": bad})
        assert store.get("agent-0", "hook.scaffold.c") is None
    kept.put("c", {"w": torch.ones(4)})
    assert store.get("agent-0", "hook.scaffold.c") is not None


def _checkpointed(federation, task, tmp_path, job: str):
    """A finished FedAdam run of one round: its engine's config and run folder."""
    cfg = _cfg(job, strategy="fedadam", rounds=1)
    _run(federation, task, tmp_path, cfg, Agent)
    return cfg, tmp_path / job


def _forge(ckpt_dir, change) -> None:
    """Rewrite the newest checkpoint with its strategy state changed, under a valid digest."""
    ckpt = load_checkpoint(ckpt_dir)
    assert ckpt is not None and ckpt.path is not None
    change(ckpt.strategy_state["fedadam"])
    ckpt.path.unlink()
    save_checkpoint(
        ckpt_dir,
        round=ckpt.round,
        model_version=ckpt.model_version,
        global_state=ckpt.global_state,
        strategy_state=ckpt.strategy_state,
        mediator_state=ckpt.mediator_state,
        rng_state=ckpt.rng_state,
        folded=ckpt.folded,
        extra=ckpt.extra,
    )


def _first(state: dict) -> str:
    return sorted(state)[0]


FORGERIES = {
    "wrong-shape": lambda s: s["v"].update({_first(s["v"]): torch.ones(3)}),
    "non-finite": lambda s: s["v"][_first(s["v"])].fill_(float("nan")),
    "overflowing": lambda s: s["m"][_first(s["m"])].fill_(1e30),
    "integer-tensor": lambda s: s["m"].update({_first(s["m"]): s["m"][_first(s["m"])].long()}),
    "not-a-tensor": lambda s: s["v"].update({_first(s["v"]): 0.5}),
    "not-a-dict": lambda s: s.update(m=[1, 2]),
    "bad-step-count": lambda s: s.update(t="many"),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_forged_strategy_state_is_refused_at_restore(federation, task, tmp_path, forgery):
    cfg, run_dir = _checkpointed(federation, task, tmp_path, f"kept-restore-{forgery}")
    _forge(run_dir / "checkpoints", FORGERIES[forgery])
    files = {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()}
    engine = Engine(connect(f"memory://{cfg.job}", user=topology.AGGREGATOR_USER), task, cfg, run_dir)
    with pytest.raises(CheckpointRefused, match="strategy 'fedadam' state") as err:
        engine._restore()
    assert "\n" not in str(err.value) and err.value.exit_code == 1
    assert engine.round == 1 and engine.strategy_state == {}  # nothing resumed
    assert {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()} == files  # nothing written
