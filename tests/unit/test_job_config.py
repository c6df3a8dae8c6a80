import re

import pytest

from fedmq.aggregator.config import JobConfig, JobConfigError


def test_defaults_are_valid_and_derived_properties():
    cfg = JobConfig()
    assert cfg.mode == "sync" and cfg.pull == "all" and not cfg.grant_phase
    assert cfg.selected_count() == 5  # C=0.5 of K=10
    assert JobConfig(strategy="fedmed").grant_phase  # the mediator needs every report first
    assert JobConfig(beta=0.5).grant_phase
    assert JobConfig(strategy="fedsgd").selected_count() == 10
    assert JobConfig(strategy="fedsgd", epochs=5).train_config().epochs == 1
    assert JobConfig(strategy="pull-global").pull == "global"
    # the first names (dp-*) read as differential privacy: still accepted, stored under the new ones
    assert (
        JobConfig(strategy="dp-l").strategy == "pull-local"
        and JobConfig(strategy="dp-random").pull == "random"
    )
    assert JobConfig(strategy="async").mode == "async"
    assert JobConfig(fraction=0.01, clients=10).selected_count() == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"strategy": "fedfoo"},
        {"rounds": 0},
        {"fraction": 0},
        {"fraction": 1.5},
        {"beta": 0},
        {"lr": -1},
        {"heartbeat_s": 0.0},
        {"optimizer": "rmsprop"},
        {"identity": "shared:"},
        {"pull_fraction": 1.0},
        {"epochs": 0},
        {"encoding": "no-such-encoding"},
        {"down_encoding": "int9"},
        {"keyframe_every": 0},
        {"strategy": "pull-global", "pull_down": True, "encoding": "delta+bf16"},
    ],
)
def test_bad_values_rejected_with_one_line(kwargs):
    with pytest.raises(JobConfigError) as err:
        JobConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(JobConfigError, match="unknown config key"):
        JobConfig.from_dict({"rounds": 3, "colour": "blue"})
    assert JobConfig.from_dict({"rounds": 3}).rounds == 3


def test_default_encodings_and_auto():
    assert (JobConfig().encoding, JobConfig().down_encoding) == ("delta+bf16", "bf16")
    assert (
        JobConfig(strategy="pull-global", pull_down=True).encoding == "raw"
    )  # pull-down uploads cannot be deltas
    assert JobConfig.from_dict(JobConfig().to_dict()).encoding == "delta+bf16"
    cfg = JobConfig(pull_down=False, down_encoding="delta+bf16", strategy="pull-local")
    # a delta base; the pulling rule's input is the pulling hook's (fedmq.upload_hooks)
    assert cfg.round_config().keep_model and cfg.pull == "local"
    assert not JobConfig().round_config().keep_model


def test_pull_share_is_of_parameters_by_default_and_validated():
    from fedmq.aggregator.strategies.registry import client_hooks

    assert client_hooks(JobConfig(strategy="pull-local"))[0][1]["by"] == "params"
    assert client_hooks(JobConfig(strategy="pull-local", pull_by="count"))[0][1]["by"] == "count"
    with pytest.raises(JobConfigError, match="pull_by 'bytes'"):
        JobConfig(strategy="pull-local", pull_by="bytes")


def test_fedsgd_is_one_full_batch_step_on_every_client():
    cfg = JobConfig(strategy="fedsgd", clients=7, fraction=0.1, epochs=5, max_steps=30).train_config()
    assert cfg.full_batch and cfg.epochs == 1 and cfg.max_steps == 0
    assert JobConfig(strategy="fedsgd", clients=7, fraction=0.1).selected_count() == 7
    assert not JobConfig(strategy="fedavg", epochs=5).train_config().full_batch


def test_fedsgd_has_a_learning_rate_of_its_own_unless_one_is_given():
    from fedmq import defaults

    assert JobConfig(strategy="fedsgd").lr == defaults.FEDSGD_LR == 1.5
    assert JobConfig(strategy="fedsgd").train_config().lr == 1.5
    assert JobConfig().lr == JobConfig(strategy="fedadam").lr == defaults.LR == 20.0
    assert JobConfig(strategy="fedsgd", lr=3.0).lr == 3.0 and JobConfig(lr=3.0).lr == 3.0
    # a job written out (config.json) and read back keeps the learning rate it ran with
    cfg = JobConfig(strategy="fedsgd")
    assert JobConfig(**{**cfg.__dict__, "strategy": "fedavg"}).lr == 1.5


@pytest.mark.parametrize(
    "values, message",
    [
        ({"rounds": "5"}, "rounds (--rounds) must be a whole number, got '5'"),
        ({"clients": True}, "clients (--clients) must be a whole number, got True"),
        ({"lr": float("inf")}, "lr (--lr) must be finite"),
        ({"lr": "fast"}, "lr (--lr) must be a number"),
        ({"strategy": ["fedavg"]}, "strategy (--strategy) must be a string"),
        ({"error_feedback": 1}, "error_feedback must be true or false"),
        ({"extra": []}, "extra must be a table"),
        ({"job": "a b"}, "bad job id 'a b'"),
        ({"momentum": -0.5}, "momentum (--momentum) must be in [0, 1], got -0.5"),
        ({"epochs": 0}, "epochs (--epochs) must be in [1, 1000], got 0"),
        ({"seed": -1}, "seed (--seed) must be in [0, 9.22337e+18], got -1"),
        ({"eval_every": 0}, "eval_every must be at least 1"),
        ({"join_timeout_s": 0.0}, "join_timeout_s must be positive"),
        ({"encoding": "no-such-encoding"}, "encoding"),
    ],
)
def test_job_config_validates_everything_it_holds(values, message):
    """A job file's JSON can hold anything: every field is checked for its type and range, one line each."""
    with pytest.raises(JobConfigError, match=re.escape(message)):
        JobConfig.from_dict(values)


def test_round_lr_decay_sets_each_rounds_learning_rate():
    """Round r's announce carries lr × round_lr_decay^(r−1); 1 (the default) keeps it constant."""
    cfg = JobConfig(lr=2.0, round_lr_decay=0.5)
    assert [cfg.train_config(r).lr for r in (1, 2, 3)] == [2.0, 1.0, 0.5]
    assert JobConfig(lr=2.0).train_config(7).lr == 2.0
    assert JobConfig(lr=1.0, round_lr_decay=0.5).train_config(5000).lr > 0  # underflow never sends lr = 0


@pytest.mark.parametrize(
    "values, message",
    [
        ({"round_lr_decay": 0.0}, "round_lr_decay (--round-lr-decay) must be positive"),
        ({"round_lr_decay": 1.5}, "round_lr_decay (--round-lr-decay) must be in (0, 1], got 1.5"),
        ({"lr_decay": 2.0}, "lr_decay must be in (0, 1], got 2.0"),
        ({"lr_decay": 0.0}, "lr_decay must be in (0, 1], got 0.0"),
    ],
)
def test_learning_rate_decays_are_checked(values, message):
    with pytest.raises(JobConfigError, match=re.escape(message)):
        JobConfig.from_dict(values)
