"""The aggregation benchmark's machinery (not its speed): shapes, per-subprocess rows, the stacking cap."""

from __future__ import annotations

import pytest

from fedmq.benchmarks.aggregate import bench_aggregate, format_table, model_shapes


@pytest.mark.parametrize("params", [25_000_000, 1_000_000, 100_000, 1000])
def test_model_shapes_add_up(params):
    shapes = model_shapes(params)
    total = 0
    for s in shapes.values():
        n = 1
        for d in s:
            n *= d
        total += n
    assert total == params


def test_tiny_run_produces_rows_and_skips_stacking_over_budget():
    rows = bench_aggregate(
        counts=(3,),
        params=50_000,
        methods=("inplace", "fedavg", "fedatt-full", "stack-fedavg"),
        stack_budget_gb=1e-4,
        repeats=2,
    )
    by = {r["method"]: r for r in rows}
    assert (
        by["inplace"]["gb_s"] > 0
        and by["fedavg"]["gb_s"] > 0
        and by["fedatt-full"]["gb_s"] > 0
        and by["inplace"]["vs_inplace"] == 1.0
    )
    assert by["fedavg"]["peak_rss_mb"] >= by["fedavg"]["base_rss_mb"] > 0
    assert "stack needs" in by["stack-fedavg"]["skipped"]
    assert by["fedavg"]["repeats"] == 2 and by["fedavg"]["vs_inplace"] > 0
    table = format_table(rows)
    assert "fedavg" in table and "stack needs" in table
