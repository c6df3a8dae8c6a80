"""Differential-privacy settings (aggregator/config.py): one way in from Python, a job file's [privacy] table
and simulate's flags, each mistake one line."""

from __future__ import annotations

import pytest

from fedmq.aggregator.config import JobConfig, JobConfigError, read_job_file


def test_python_settings_and_their_defaults():
    cfg = JobConfig(dp="central", clip_norm="0.5")  # a flag's text is read as the number
    assert (cfg.clip_norm, cfg.noise_multiplier, cfg.target_epsilon, cfg.delta) == (0.5, None, None, None)
    assert JobConfig(dp="central", clip_norm="adaptive").clip_norm == "adaptive"
    assert JobConfig().dp == "none"


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"dp": "central", "clip_norm": -1.0}, "S must be positive"),
        ({"dp": "central", "clip_norm": "big"}, 'a number or "adaptive"'),
        ({"dp": "central", "clip_quantile": 1.0}, "clip_quantile"),
        ({"dp": "central", "noise_multiplier": -0.5}, "z must not be negative"),
        ({"dp": "central", "target_epsilon": -2.0}, "ε must be positive"),
        ({"dp": "central", "target_epsilon": 2.0, "noise_multiplier": 1.0}, "not both"),
        ({"dp": "central", "clients": 100, "delta": 0.01}, "(0, 0.01)"),
        ({"dp": "central", "strategy": "fedatt"}, "needs an averaging strategy"),
        ({"dp": "central", "strategy": "pull-local"}, "needs an averaging strategy"),
        ({"dp": "central", "robust": "trimmed:0.1"}, "robust"),
        ({"dp": "central", "noise": 0.1}, "states no ε"),
        ({"noise_multiplier": 1.0}, "needs dp (--dp) central or client"),
        ({"dp": "client", "encoding": "delta+topk:0.1"}, "error_feedback = false"),
    ],
)
def test_bad_settings_are_one_line(settings, needle):
    with pytest.raises(JobConfigError) as err:
        JobConfig(**settings)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_job_file_takes_a_privacy_table(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[privacy]\nmode = "client"\nclip_norm = 1\ntarget_epsilon = 8\ndelta = 1e-6\n')
    job = read_job_file(path).job
    assert job == {"dp": "client", "clip_norm": 1.0, "target_epsilon": 8.0, "delta": 1e-6}
    cfg = JobConfig.from_dict(job)
    assert (cfg.dp, cfg.clip_norm, cfg.target_epsilon) == ("client", 1.0, 8.0)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ('dp = "central"\n', "belongs in the [privacy] table"),
        ("[privacy]\nz = 1\n", "unknown key privacy.z"),
        ('privacy = "on"\n', "must be a [privacy] table"),
        ('[privacy]\nmode = "central"\nclip_norm = true\n', "clip_norm must be"),
    ],
)
def test_bad_privacy_tables_are_one_line(tmp_path, content, needle):
    path = tmp_path / "job.toml"
    path.write_text(content)
    with pytest.raises(JobConfigError) as err:
        read_job_file(path)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_inbox_is_sized_for_the_most_a_poisson_sample_selects():
    plain = JobConfig(clients=10_000, fraction=0.01)
    private = JobConfig(clients=10_000, fraction=0.01, dp="central")
    assert plain.most_selected() == plain.selected_count() == 100
    assert 100 + 6 * (100 * 0.99) ** 0.5 < private.most_selected() <= 161  # mean + 6 standard deviations
    assert JobConfig(clients=8, fraction=0.5, dp="central").most_selected() == 8  # never above K
