"""`fedmq bench flower` starts Ray with its workers at the driver's priority: by default Ray renices its
worker processes (Flower's client actors) by +15, and on a busy machine Flower's clients would then train
below fedmq's. The bench's Flower side and the control both say so in the arguments Flower hands to
``ray.init`` (tests/integration/test_flower_niceness.py checks the workers' nice value)."""

from __future__ import annotations

from fedmq.benchmarks import flower_app, flower_control


def test_the_bench_flower_side_starts_ray_workers_unreniced() -> None:
    config = flower_app.backend_config(1.0, 2)
    assert config["init_args"]["_system_config"] == {"worker_niceness": 0}
    assert config["init_args"]["num_cpus"] == 2
    assert config["client_resources"] == {"num_cpus": 1.0, "num_gpus": 0.0}


def test_the_control_starts_ray_workers_unreniced() -> None:
    assert flower_control.backend_config()["init_args"]["_system_config"] == {"worker_niceness": 0}


def test_a_round_row_behind_a_ray_log_line_on_the_same_line_is_read():
    from fedmq.benchmarks.flower import round_rows

    out = "\n".join(
        [
            '{"round": 1, "end": 1.0}',
            '\x1b[92mINFO \x1b[0m:      configure{"round": 2, "end": 2.0}',
            "INFO : something else",
            '{"round": 3, "end": 3.0',  # cut short: not a row
        ]
    )
    assert [r["round"] for r in round_rows(out)] == [1, 2]
