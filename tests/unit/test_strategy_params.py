"""A strategy's parameters have one way in, its constructor's arguments; the former JobConfig keys that were
built-in strategies' parameters (aggregator.job_keys.FORMER_KEYS) are still read from old job files and run
folders, and the flags kept for them are aliases of the parameter."""

from __future__ import annotations

import json
import logging
import re

import fedmq_procs
import pytest

from fedmq.aggregator import job_keys
from fedmq.aggregator.config import JobConfig, read_job_file
from fedmq.aggregator.job_keys import FORMER_KEYS, JobConfigError
from fedmq.aggregator.strategies.fedavg import FedAvg
from fedmq.errors import BadParameter

URL = "amqp://guest:guest@127.0.0.1:1/%2F"  # never reached


@pytest.fixture
def fresh_warnings(monkeypatch):
    """This process has not warned of any former key yet."""
    monkeypatch.setattr(job_keys, "_said", set())


def plan(*args: str, saved: dict | None = None):
    import typer

    from fedmq.cli.app import app, simulate
    from fedmq.cli.simulate_options import from_context

    ctx = typer.main.get_command(app).commands["simulate"].make_context("simulate", list(args))
    return from_context(ctx, simulate, saved)


def test_each_parameter_has_one_default():
    """The constructors' defaults are the values the former job keys had (what users ran), except async's
    buffer, 5 since the defaults sweep (docs/guide/strategy.md), and never more than the job's clients."""
    from fedmq.aggregator.strategies.registry import make_strategy, strategy_from_config

    buffered, att = make_strategy("async"), make_strategy("fedatt")
    assert (buffered.buffer_size, buffered.max_staleness, buffered.server_lr) == (5, 5, 1.0)
    assert (att.epsilon, att.norm) == (1.2, "fro")
    assert not set(FORMER_KEYS) & set(JobConfig().to_dict())  # no second default in the job
    small = JobConfig(strategy="async", clients=4)
    assert strategy_from_config("async", small)[1].buffer_size == 4
    given = JobConfig(strategy="async", clients=4, strategy_args={"buffer_size": 6})
    assert strategy_from_config("async", given)[1].buffer_size == 6  # as given: it waits for deadlines


def test_an_old_job_file_is_read_as_the_strategys_parameters_and_says_so_once(
    tmp_path, caplog, fresh_warnings
):
    job = tmp_path / "job.toml"
    job.write_text('strategy = "async"\nasync_k = 4\nmax_staleness = 2\nserver_lr = 0.5\n')
    with caplog.at_level(logging.WARNING, logger="fedmq.aggregator.job_keys"):
        cfg = JobConfig.from_dict(read_job_file(job).job)
        JobConfig.from_dict(read_job_file(job).job)  # read twice: said once
    assert cfg.strategy_args == {"buffer_size": 4, "max_staleness": 2, "server_lr": 0.5}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "async_k -> async parameter buffer_size" in lines[0]
    assert "--strategy-arg buffer_size=" in lines[0] and "[strategy] buffer_size" in lines[0]


def test_a_former_key_of_another_strategy_is_ignored_as_before(fresh_warnings):
    cfg = JobConfig.from_dict({"strategy": "fedavg", "att_eps": 0.5, "async_k": 7})
    assert cfg.strategy_args == {}
    assert JobConfig.from_dict({"strategy": "fedatt", "async_k": 7}).strategy_args == {}


def test_a_former_key_and_the_parameter_must_agree(fresh_warnings):
    same = {"name": "fedatt", "epsilon": 0.5}
    assert JobConfig.from_dict({"strategy": same, "att_eps": 0.5}).strategy_args == {"epsilon": 0.5}
    with pytest.raises(JobConfigError, match="att_eps sets epsilon = 0.9, .* epsilon = 0.5: give it once"):
        JobConfig.from_dict({"strategy": same, "att_eps": 0.9})


def test_a_former_key_of_the_wrong_type_in_a_job_file_is_one_line(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('strategy = "async"\nasync_k = "ten"\n')
    with pytest.raises(JobConfigError, match=f"config file {job}: async_k must be a whole number"):
        read_job_file(job)


def test_an_old_run_folder_resumes_with_the_parameters_it_ran(fresh_warnings):
    """config.json from before: every former key at the value the run had; the run continues with them."""
    from fedmq.aggregator.strategies.registry import strategy_from_config

    old = {k: v for k, v in JobConfig(strategy="async").to_dict().items() if k != "strategy_args"}
    old.update(att_eps=1.2, att_norm="fro", async_k=6, max_staleness=4, server_lr=0.75)
    cfg = JobConfig.from_dict(json.loads(json.dumps(old)))
    buffered = strategy_from_config("async", cfg)[1]
    assert (buffered.buffer_size, buffered.max_staleness, buffered.server_lr) == (6, 4, 0.75)


def test_eps_and_norm_are_aliases_of_fedatts_parameters():
    p = plan("--strategy", "fedatt", "--eps", "0.9", "--norm", "spectral")
    assert p.job.strategy_args == {"epsilon": 0.9, "norm": "spectral"}
    assert plan("--eps", "0.9").job.strategy_args == {}  # FedAvg never read it
    assert plan("--strategy", "fedatt").job.strategy_args == {}  # the constructor's default
    with pytest.raises(JobConfigError, match="--eps sets epsilon = 0.9, .* epsilon = 0.5: give it once"):
        plan("--strategy", "fedatt", "--eps", "0.9", "--strategy-arg", "epsilon=0.5")


def test_simulate_reads_the_strategy_table_of_a_job_file(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[strategy]\nname = "fedadam"\nserver_lr = 0.01\ntau = 1e-3\n')
    p = plan("--config", str(job))
    assert (p.job.strategy, p.job.strategy_args) == ("fedadam", {"server_lr": 0.01, "tau": 1e-3})
    p = plan("--config", str(job), "--strategy-arg", "tau=0.1")  # the flag over the table
    assert p.job.strategy_args == {"server_lr": 0.01, "tau": 0.1}
    old = tmp_path / "old.toml"
    old.write_text('strategy = "fedatt"\natt_eps = 0.7\n')
    assert plan("--config", str(old)).job.strategy_args == {"epsilon": 0.7}


def test_every_command_reads_the_strategy_table(tmp_path):
    """The guide's own example, through every command that takes --config: simulate and agent run go past
    the file to a later check of their own, aggregator run prints what it read."""
    job = tmp_path / "job.toml"
    job.write_text('[strategy]\nname = "fedadam"\nserver_lr = 0.01\ntau = 1e-3\n')
    done = fedmq_procs.fedmq(
        "simulate", "--config", str(job), "--device", "tpu", "--out", str(tmp_path / "r")
    )
    assert done.returncode == 2 and "unknown --device 'tpu'" in done.stderr, done.stderr
    done = fedmq_procs.fedmq(
        "aggregator", "run", "--broker", URL, "--config", str(job), "--state-dir", str(tmp_path / "s"),
        "--print-config",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert (printed["strategy"], printed["strategy_args"]) == ("fedadam", {"server_lr": 0.01, "tau": 1e-3})
    done = fedmq_procs.fedmq(
        "agent", "run", "--broker", URL, "--job", "j", "--client-id", "agent-0", "--config", str(job),
        "--trainers", "2",
    )  # fmt: skip
    assert done.returncode != 0 and "--trainers and --client-state are a host's options" in done.stderr
    assert "config file" not in done.stderr, done.stderr


def test_an_asynchronous_strategy_of_ones_own_names_its_window():
    from fedmq.aggregator.async_rounds import async_window
    from fedmq.aggregator.strategies.buffered_async import BufferedAsync
    from fedmq.aggregator.strategies.fedavg import FedAvg
    from fedmq.errors import BadParameter

    class NoWindow(FedAvg):
        name = "no-window"
        plan = BufferedAsync.plan

    cfg = JobConfig(strategy="async")
    assert async_window(cfg, BufferedAsync(buffer_size=4, max_staleness=2)) == (4, 2)
    assert async_window(cfg, FedAvg()) == (1, 0)
    with pytest.raises(BadParameter, match="needs int attributes buffer_size and max_staleness"):
        async_window(cfg, NoWindow())


def test_built_in_parameter_names_read_without_torch_are_their_signatures():
    import inspect

    from fedmq.aggregator.strategies.registry import STRATEGY_NAMES, strategy_class
    from fedmq.aggregator.strategies.signatures import builtin_params

    for name in STRATEGY_NAMES:
        assert builtin_params(name) == tuple(sorted(inspect.signature(strategy_class(name)).parameters)), name
    assert builtin_params("no-such-strategy") is None


@pytest.mark.parametrize(
    "strategy, args, needle",
    [
        ("fedadam", {"server-lr": 0.01}, "has no parameter 'server-lr' (did you mean server_lr?); it takes"),
        ("fedatt", {"eps": 1.0}, "strategy 'fedatt' has no parameter 'eps'; it takes epsilon, norm"),
        ("fedavg", {"mu": 0.1}, "strategy 'fedavg' has no parameter 'mu'; it takes no parameters"),
    ],
)
def test_a_built_in_strategys_keys_are_checked_by_the_job(strategy, args, needle):
    """By name, from the constructor's signature, when the job is built (no torch needed)."""
    with pytest.raises(JobConfigError) as err:
        JobConfig(strategy=strategy, strategy_args=args)
    assert needle in str(err.value)


class Refuses(FedAvg):
    """A user's strategy whose constructor refuses its argument in its own words."""

    name = "refuses"

    def __init__(self, limit: float = 1.0) -> None:
        raise BadParameter(f"limit must be below 1, got {limit}")


def test_a_strategys_refusal_names_it_and_fedatts_names_its_flag():
    from fedmq.aggregator.strategies import registry

    user = f"{__name__}:Refuses"
    with pytest.raises(BadParameter, match=re.escape(f"strategy {user!r}: limit must be below 1, got 2.0")):
        registry.make_strategy(user, limit=2.0)
    with pytest.raises(BadParameter, match=re.escape("strategy 'fedatt': epsilon (--eps) must be > 0.0")):
        registry.make_strategy("fedatt", epsilon=0.0)
    with pytest.raises(BadParameter, match=re.escape("strategy 'fedatt': norm (--norm) must be one of")):
        registry.make_strategy("fedatt", norm="l7")


def test_a_run_recorded_with_the_former_keys_counts_as_run_with_its_parameters(tmp_path, fresh_warnings):
    """benchmarks' ran_as: an archived run's att_eps is FedAtt's epsilon; a default is a default however
    it is given."""
    from fedmq.aggregator.runlog import CONFIG_FILE
    from fedmq.benchmarks.experiments.runner import ran_as

    old = JobConfig(strategy="fedatt").to_dict()
    old.update(att_eps=1.2, att_norm="fro", async_k=3, max_staleness=5, server_lr=1.0)
    (tmp_path / CONFIG_FILE).write_text(json.dumps(old))
    assert ran_as(tmp_path, JobConfig(strategy="fedatt"))
    assert ran_as(tmp_path, JobConfig(strategy="fedatt", strategy_args={"epsilon": 1.2}))
    assert not ran_as(tmp_path, JobConfig(strategy="fedatt", strategy_args={"epsilon": 0.5}))
