"""`fedmq bench population`'s RabbitMQ row: the aggregator's peak RSS is read from /proc and printed."""

from __future__ import annotations

import os

from fedmq.benchmarks import population


def test_peak_rss_reads_a_live_process_and_is_zero_for_a_gone_one():
    held = bytearray(64 * 2**20)  # touch 64 MiB so the high-water mark is at least that
    held[::4096] = b"\x01" * len(held[::4096])
    assert population._peak_rss(os.getpid()) >= 64 * 2**20
    assert population._peak_rss(2**22 + 12345) == 0  # above Linux's pid_max default: no such process


def test_the_services_line_names_the_aggregators_peak_memory():
    row = {
        "clients": 10_000,
        "selected": 1_000,
        "hosts": 4,
        "rounds": 2,
        "confirmed": 2_000,
        "folded": 2_000,
        "lost": 0,
        "duplicated": 0,
        "queues": 11,
        "rabbitmq_memory_mb": 300.0,
        "rabbitmq_memory_before_mb": 120.0,
        "aggregator_peak_mb": 412.4,
        "s_per_round": 30.0,
        "exit_codes": [0, 0, 0, 0, 0],
        "wall_s": 90.0,
    }
    table = population.format_table([], [row])
    assert "the aggregator's peak RSS 412 MB" in table and "0 lost" in table
    assert "the aggregator's peak RSS not measured" in population.format_table(
        [], [{**row, "aggregator_peak_mb": None}]
    )
    edges = population.format_table([], [{**row, "edges": 4, "edge_peak_mb": 266.2}])
    assert "412 MB, through 4 edge aggregators (each at most 266 MB)" in edges
