"""The run folder's per-round records: metrics.csv equal to metrics.jsonl, TensorBoard scalars,
and a resume."""

from __future__ import annotations

import csv
import json

import pytest

from fedmq.aggregator.runlog import CSV_COLUMNS, RunLog

TEXT = {"strategy", "metric", "skip_reason"}  # written as they are; every other non-empty cell is JSON


def row(rnd: int, valid: float | None = None, skipped: bool = False) -> dict:
    """A round as aggregator.engine.Engine._row writes it."""
    received = [] if skipped else ["agent-0", "agent-2"]
    return {
        "round": rnd,
        "time": 1_700_000_000.5 + rnd,
        "version": rnd,
        "strategy": "fedavg",
        "metric": "perplexity",
        "valid": None if skipped else (valid or 100.0 / rnd),
        "mean_loss": None if skipped else 5.25 - rnd / 3,
        "online": ["agent-0", "agent-1", "agent-2"],
        "selected": ["agent-0", "agent-1", "agent-2"],
        "reported": received,
        "losses": {c: 5.0 for c in received},
        "granted": received,
        "received": received,
        "update_ids": {c: f"id-{rnd}-{c}" for c in received},
        "dropped": ["agent-1"],
        "skipped": skipped,
        "skip_reason": "0 update(s) < min 1" if skipped else None,
        "bytes_up": 1000 * rnd,
        "bytes_down": 3000,
        "bytes_up_raw": 4000 * rnd,
        "bytes_down_raw": 6000,
        "wall_s": 0.125 * rnd,
        "weights": {} if skipped else {"agent-0": 0.25, "agent-2": 0.75},
        "rejected": {"bad-digest": 1},
        "dropped_msgs": {},
    }


def csv_rows(path) -> list[dict]:
    """metrics.csv read back independently of the writer: empty is None, text columns as they are,
    else JSON."""
    with open(path, newline="") as fh:
        table = list(csv.reader(fh))
    assert table[0] == list(CSV_COLUMNS)
    out = []
    for cells in table[1:]:
        rec = {
            name: (None if cell == "" else cell if name in TEXT else json.loads(cell))
            for name, cell in zip(table[0], cells)
        }
        rec.update(rec.pop("extra") or {})
        if rec["delta"] is None:  # a run without differential privacy: its rows have no epsilon or delta
            del rec["epsilon"], rec["delta"]
        out.append(rec)
    return out


def board(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def steps(acc, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_csv_rows_equal_the_json_lines(tmp_path):
    log = RunLog(tmp_path)
    rows = [
        row(1),
        row(2, skipped=True),
        {**row(3), "fold_order": ["agent-2", "agent-0"]},
    ]  # a key CSV_COLUMNS lacks
    for r in rows:
        log.append(r)
    log.write_summary({})
    assert [r.to_json() for r in log.rows()] == rows
    assert csv_rows(tmp_path / "metrics.csv") == rows


def test_a_dp_rows_epsilon_and_delta_are_csv_columns_and_a_tensorboard_scalar(tmp_path):
    log = RunLog(tmp_path)
    rows = [{**row(1), "epsilon": 0.5, "delta": 1e-5}, {**row(2), "epsilon": None, "delta": 1e-5}]
    for r in rows:
        log.append(r)
    log.write_summary({})
    assert [r.to_json() for r in log.rows()] == rows
    assert csv_rows(tmp_path / "metrics.csv") == rows
    assert [e.value for e in board(tmp_path / "tb").Scalars("privacy/epsilon")] == [0.5]


def test_tensorboard_has_score_loss_bytes_participation_and_weights_per_round(tmp_path):
    log = RunLog(tmp_path)
    for r in (row(1), row(2, skipped=True), row(3)):
        log.append(r)
    log.write_summary({})
    acc = board(tmp_path / "tb")
    tags = set(acc.Tags()["scalars"])
    assert {
        "valid/perplexity",
        "train/mean_loss",
        "bytes/up",
        "bytes/down",
        "bytes/up_raw",
        "bytes/down_raw",
        "participation/online",
        "participation/selected",
        "participation/received",
        "participation/dropped",
        "participation/skipped",
        "round/wall_s",
        "weights/agent-0",
        "weights/agent-2",
    } <= tags
    assert steps(acc, "valid/perplexity") == [
        (1, 100.0),
        (3, pytest.approx(100.0 / 3)),
    ]  # skipped: no score (float32)
    assert steps(acc, "bytes/up") == [(1, 1000.0), (2, 2000.0), (3, 3000.0)]
    assert steps(acc, "participation/received") == [(1, 2.0), (2, 0.0), (3, 2.0)]
    assert steps(acc, "weights/agent-2") == [(1, 0.75), (3, 0.75)]
    assert [e.step for e in acc.Histograms("weights")] == [1, 3]
    assert [e.wall_time for e in acc.Scalars("bytes/up")] == [r["time"] for r in (row(1), row(2), row(3))]


def test_resume_appends_to_the_same_csv_and_tensorboard_without_duplicate_rounds(tmp_path):
    first = RunLog(tmp_path)
    for rnd in (1, 2, 3):  # round 3's row written, then killed before its checkpoint: it is run again
        first.append(row(rnd))
    first.close()
    resumed = RunLog(tmp_path)  # a new process
    resumed.truncate_after(2)
    assert csv_rows(tmp_path / "metrics.csv") == [row(1), row(2)]
    for r in (row(3, valid=7.0), row(4)):
        resumed.append(r)
    resumed.write_summary({})
    expected = [row(1), row(2), row(3, valid=7.0), row(4)]
    assert [r.to_json() for r in resumed.rows()] == expected and csv_rows(
        tmp_path / "metrics.csv"
    ) == expected
    assert steps(board(tmp_path / "tb"), "valid/perplexity") == [(1, 100.0), (2, 50.0), (3, 7.0), (4, 25.0)]


def test_a_run_folder_from_before_csv_and_tensorboard_gets_both_on_resume(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row(r)) + "\n" for r in (1, 2)))
    log = RunLog(tmp_path)
    log.truncate_after(2)
    log.append(row(3))
    log.write_summary({})
    assert csv_rows(tmp_path / "metrics.csv") == [row(1), row(2), row(3)]
    assert [s for s, _ in steps(board(tmp_path / "tb"), "bytes/up")] == [1, 2, 3]
