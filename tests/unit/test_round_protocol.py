"""The typed round config (broker.wire.messages.RoundConfig) and the strategies that shape it (RoundPlan,
configure_train, from_config): what the agents are told each round comes from the strategy,
not from its name."""

from __future__ import annotations

import dataclasses

import pytest

from fedmq.aggregator.config import JobConfig, JobConfigError
from fedmq.aggregator.strategies.base import RoundPlan, Strategy
from fedmq.aggregator.strategies.fedavg import FedAvg
from fedmq.aggregator.strategies.registry import STRATEGY_NAMES, strategy_class, strategy_from_config
from fedmq.broker.wire import messages
from fedmq.broker.wire.messages import RoundConfig
from fedmq.errors import CodecError
from fedmq.train_config import TrainConfig


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
        (lambda c: c["train"].pop("lr"), "train lacks lr"),
        (lambda c: c.pop("grant"), "must have train, encoding, grant and keep_model"),
        (lambda c: c.update(train=[1]), "train must be a map"),
        (lambda c: c["train"].update(epochs="3"), "train epochs must be int"),
        (lambda c: c.update(grant=1), "grant must be true or false"),
        (lambda c: c["train"].update(epochs=True), "train epochs must be int"),
        (lambda c: c["train"].update(lr=float("nan")), "train lr must be in"),
        (lambda c: c["train"].update(lr=0.0), r"train lr must be in \(0, 10000\], got 0.0"),
        (lambda c: c["train"].update(epochs=0), r"train epochs must be in \[1, 1000\], got 0"),
        (lambda c: c["train"].update(optimizer="lbfgs"), "train optimizer must be one of sgd, adam"),
        (lambda c: c.update(encoding="no-such-encoding"), "encoding"),
        (lambda c: c.update(encoding=7), "encoding"),
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
    assert JobConfig(strategy="fedmed").round_config().train.tail_loss
    assert not JobConfig(strategy="fedavg").round_config().train.tail_loss
    sgd = JobConfig(strategy="fedsgd", epochs=5, max_steps=9).train_config()
    assert (sgd.epochs, sgd.full_batch, sgd.max_steps) == (1, True, 0)


def test_from_config_reads_the_job_settings():
    att_args = {"epsilon": 0.7, "norm": "spectral"}
    name, att = strategy_from_config("fedatt", JobConfig(strategy="fedatt", strategy_args=att_args))
    assert (name, att.epsilon, att.norm) == ("fedatt", 0.7, "spectral")
    async_args = {"buffer_size": 4, "server_lr": 0.5}
    name, buffered = strategy_from_config("async", JobConfig(strategy="async", strategy_args=async_args))
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
    def configure_train(cls, train: TrainConfig) -> TrainConfig:
        return dataclasses.replace(train, epochs=2)


def test_a_users_strategy_owns_its_round():
    cfg = JobConfig(strategy=f"{__name__}:EveryoneTwice", clients=6, fraction=0.2)
    assert cfg.selected_count() == 6 and cfg.grant_phase
    rc = cfg.round_config()
    assert rc.train.epochs == 2 and rc.grant
    assert isinstance(strategy_from_config(cfg.strategy, cfg)[1], Strategy)


def test_a_built_in_strategys_parameter_has_one_way_in_and_is_never_ignored():
    # a built-in's parameters are its constructor's, also those that were job settings (FedAtt's epsilon was
    # att_eps): a former key in a job file or config.json is read as the parameter
    old = JobConfig.from_dict({"strategy": "fedatt", "att_eps": 0.9})
    assert strategy_from_config("fedatt", old)[1].epsilon == 0.9
    fedatt = JobConfig(strategy="fedatt", strategy_args={"epsilon": 0.7})
    assert strategy_from_config("fedatt", fedatt)[1].epsilon == 0.7
    buffered = JobConfig(strategy="async", strategy_args={"server_lr": 0.25})
    assert strategy_from_config("async", buffered)[1].server_lr == 0.25
    with pytest.raises(JobConfigError, match="strategy 'fedatt' has no parameter 'att_eps'"):
        JobConfig(strategy="fedatt", strategy_args={"att_eps": 0.7})  # by name, before torch
    # the job's arguments are checked against the job's strategy even where a robust guard replaces it
    with pytest.raises(JobConfigError, match="strategy 'fedavg' has no parameter 'clip_norm'"):
        JobConfig(robust="clip:2.5", strategy_args={"clip_norm": 1.0})
    assert strategy_from_config("fedavg", JobConfig(robust="clip:2.5"))[1].clip_norm == 2.5
