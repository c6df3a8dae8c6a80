"""The typed round config (broker.wire.messages.RoundConfig) and the strategies that shape it (RoundPlan,
configure_train, from_config): what the agents are told each round comes from the strategy,
not from its name."""

from __future__ import annotations

import dataclasses

import pytest

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.strategies.base import RoundPlan, Strategy
from fedmq.aggregator.strategies.fedavg import FedAvg
from fedmq.aggregator.strategies.registry import STRATEGY_NAMES, strategy_class, strategy_from_config
from fedmq.broker.wire import messages
from fedmq.broker.wire.messages import RoundConfig
from fedmq.errors import CodecError


def _announce(config: object) -> bytes:
    env = messages.announce("j", 1, 0, ["a"], JobConfig().round_config(), [])
    env.payload["config"] = config
    return messages.pack(env)


def test_round_config_round_trips_through_an_announce():
    cfg = JobConfig(strategy="pull-local", epochs=3, momentum=0.5).round_config()
    env = messages.decode(messages.encode(messages.announce("j", 1, 0, ["a"], cfg, [])))
    assert RoundConfig.from_payload(env.payload["config"]) == cfg


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda c: c.pop("lr"), "exactly the fields"),
        (lambda c: c.update(extra=1), "exactly the fields"),
        (lambda c: c.update(epochs="3"), "epochs must be a int"),
        (lambda c: c.update(grant=1), "grant must be a bool"),
        (lambda c: c.update(epochs=True), "epochs must be a int"),
        (lambda c: c.update(lr=float("nan")), "lr is not finite"),
        (lambda c: c.update(lr=0.0), "lr=0.0 is out of range"),
        (lambda c: c.update(epochs=0), "epochs=0 is out of range"),
        (lambda c: c.update(pull="half"), "pull='half' is out of range"),
        (lambda c: c.update(pull_fraction=1.0), "pull_fraction=1.0 is out of range"),
        (lambda c: c.update(optimizer="lbfgs"), "optimizer='lbfgs' is out of range"),
        (lambda c: c.update(encoding="no-such-encoding"), "encoding"),
    ],
)
def test_a_bad_round_config_is_a_bad_payload(change, match):
    config = JobConfig().round_config().to_payload()
    change(config)
    with pytest.raises(CodecError, match=match) as info:
        messages.decode(_announce(config))
    assert info.value.reason == "bad-payload"


def test_announce_mode_is_checked():
    env = messages.announce("j", 1, 0, ["a"], JobConfig().round_config(), [], mode="sometimes")
    with pytest.raises(CodecError, match="sync or async"):
        messages.encode(env)


def test_every_strategy_declares_its_round():
    plans = {name: strategy_class(name).plan for name in STRATEGY_NAMES}
    assert plans["fedsgd"] == RoundPlan(select_all=True)
    assert plans["fedmed"] == RoundPlan(grant_phase=True, loss_switch=True)
    assert plans["async"].mode == "async"
    assert {plans[f"pull-{r}"].pull for r in ("local", "global", "random")} == {"local", "global", "random"}
    assert all(plans[n] == RoundPlan() for n in ("fedavg", "fedatt", "fedavg-clip", "trimmed-mean", "median"))


def test_configure_train_shapes_the_round_config():
    assert JobConfig(strategy="fedmed").round_config().tail_loss
    assert not JobConfig(strategy="fedavg").round_config().tail_loss
    sgd = JobConfig(strategy="fedsgd", epochs=5, max_steps=9).round_config()
    assert (sgd.epochs, sgd.full_batch, sgd.max_steps) == (1, True, 0)


def test_from_config_reads_the_job_settings():
    name, att = strategy_from_config("fedatt", JobConfig(strategy="fedatt", att_eps=0.7, att_norm="spectral"))
    assert (name, att.epsilon, att.norm) == ("fedatt", 0.7, "spectral")
    name, buffered = strategy_from_config("async", JobConfig(strategy="async", async_k=4, server_lr=0.5))
    assert (name, buffered.buffer_size, buffered.server_lr) == ("async", 4, 0.5)
    # the robust guard replaces plain FedAvg, also FedMed's fallback to it, and nothing else
    assert strategy_from_config("fedavg", JobConfig(robust="clip:2.5"))[1].clip_norm == 2.5
    assert strategy_from_config("fedavg", JobConfig(robust="median", clients=7))[0] == "median"
    assert strategy_from_config("fedsgd", JobConfig(strategy="fedsgd", robust="median"))[0] == "fedsgd"


class EveryoneTwice(FedAvg):
    """A user's strategy that owns its round: every client, two local epochs, a grant phase."""

    name = "everyone-twice"
    plan = RoundPlan(select_all=True, grant_phase=True)

    @classmethod
    def configure_train(cls, train: RoundConfig) -> RoundConfig:
        return dataclasses.replace(train, epochs=2)


def test_a_users_strategy_owns_its_round():
    cfg = JobConfig(strategy=f"{__name__}:EveryoneTwice", clients=6, fraction=0.2)
    assert cfg.selected_count() == 6 and cfg.grant_phase
    train = cfg.round_config()
    assert train.epochs == 2 and train.grant
    assert isinstance(strategy_from_config(cfg.strategy, cfg)[1], Strategy)
