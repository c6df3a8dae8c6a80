"""CI load smoke: 100 lightweight agents against a real `fedmq aggregator run` over RabbitMQ, nothing lost."""

from __future__ import annotations

import math

import pytest
from load_factor import budget, factor

from fedmq.benchmarks.load import bench_load, format_table

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow, pytest.mark.timing]


def test_100_agents_two_rounds_nothing_lost(rabbit_url):
    (row,) = bench_load(rabbit_url, agents=(100,), rounds=2, threads=2, timeout_s=budget(120))
    print(format_table([row]))
    assert row["rounds"] == 2 and row["updates_folded"] == 200
    assert row["lost"] == 0 and row["duplicated"] == 0
    assert row["updates_per_s"] > 10 / factor() and math.isfinite(row["p99_s"]) and row["p99_s"] < budget(30)
    assert 0 < row["agg_peak_rss_mb"] < 2048
