"""RoundRecord (aggregator/records.py) and the run folder's readers (aggregator/runlog.py): the JSON round
trip is byte-exact, malformed rows are refused with a clear message,
older rows and archived run folders still load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedmq.aggregator.records import MalformedRow, RoundRecord
from fedmq.aggregator.runlog import RunFolderError, RunLog, read_rounds, read_run
from fedmq.cli.errors import UsageError
from fedmq.cli.run_folder import check
from tests.unit.test_runlog import row

ROOT = Path(__file__).resolve().parents[2]
OLD_RUNS = ROOT / "tests" / "fixtures" / "run-folders"  # written before RoundRecord existed (README.md there)


def test_an_engine_row_round_trips_exactly():
    guarded = {**row(3), "guard": {"dropped": {"agent-2": "norm"}, "capped": {}}, "fold_order": ["agent-0"]}
    for raw in (row(1), row(2, skipped=True), guarded):
        record = RoundRecord.from_json(raw)
        assert record.to_json() == raw
        assert json.dumps(record.to_json(), sort_keys=True) == json.dumps(raw, sort_keys=True)
    record = RoundRecord.from_json(guarded)
    assert record.guard == {"dropped": {"agent-2": "norm"}, "capped": {}} and record.extra == {
        "fold_order": ["agent-0"]
    }
    assert record.received == ("agent-0", "agent-2") and record.weights == {"agent-0": 0.25, "agent-2": 0.75}


def test_a_record_without_a_guard_writes_no_guard_key():
    out = RoundRecord(4, valid=3.5).to_json()
    assert "guard" not in out and "extra" not in out
    assert out["round"] == 4 and out["online"] == [] and out["weights"] == {} and out["skipped"] is False


def test_an_older_row_gets_neutral_values_and_keeps_unknown_keys():
    central = {"round": 2, "valid": 384.7, "train_loss": 6.3, "steps": 127}  # the centralized baseline's row
    record = RoundRecord.from_json(central)
    assert (record.round, record.valid, record.strategy, record.bytes_up, record.received) == (
        2,
        384.7,
        None,
        None,
        (),
    )
    assert record.extra == {"train_loss": 6.3, "steps": 127}
    assert record.to_json()["train_loss"] == 6.3


@pytest.mark.parametrize(
    "raw, message",
    [
        ([1, 2], "must be a JSON object, not list"),
        ({"valid": 1.0}, "'round' must be an integer >= 0, not None"),
        ({"round": -1}, "'round' must be an integer >= 0, not -1"),
        ({"round": True}, "'round' must be an integer >= 0, not True"),
        ({"round": 1, "valid": "low"}, "'valid' must be a number or null, not str"),
        ({"round": 1, "bytes_up": 1.5}, "'bytes_up' must be an integer or null, not float"),
        ({"round": 1, "strategy": 3}, "'strategy' must be text or null, not int"),
        ({"round": 1, "online": "agent-0"}, "'online' must be a list of client ids or null, not str"),
        ({"round": 1, "received": [1]}, "'received' must be a list of client ids or null, not list"),
        ({"round": 1, "weights": {"a": "x"}}, "'weights' must be a map of numbers or null, not dict"),
        ({"round": 1, "rejected": {"stale": True}}, "'rejected' must be a map of counts or null, not dict"),
        ({"round": 1, "skipped": "no"}, "'skipped' must be true or false or null, not str"),
        ({"round": 1, "guard": []}, "'guard' must be an object or null, not list"),
    ],
)
def test_a_malformed_row_is_refused_with_the_key_it_trips_on(raw, message):
    with pytest.raises(MalformedRow) as err:
        RoundRecord.from_json(raw)
    assert message in str(err.value)


def test_the_run_log_writes_only_rows_that_read_back(tmp_path):
    log = RunLog(tmp_path)
    with pytest.raises(MalformedRow, match="'valid'"):
        log.append({**row(1), "valid": "low"})
    log.append(RoundRecord.from_json(row(1)))
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == json.dumps(row(1), sort_keys=True) + "\n"


def test_malformed_and_torn_lines_are_counted_never_fatal(tmp_path):
    assert read_rounds(tmp_path).records == () and read_rounds(tmp_path / "none").malformed == 0
    lines = [
        json.dumps(row(1)),
        '{"round": "x"}',
        "",
        json.dumps(row(2)),
        json.dumps(row(2, valid=9.0)),
        json.dumps(row(3))[:40],
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    rounds = read_rounds(tmp_path)
    assert [r.round for r in rounds.records] == [1, 2, 2] and rounds.malformed == 2
    latest, replaced = rounds.latest()
    assert [r.valid for r in latest] == [100.0, 9.0] and replaced == 1


def test_a_resume_keeps_the_kept_lines_byte_for_byte(tmp_path):
    old = [
        json.dumps({"round": 1, "valid": 5, "train_loss": 1.0}),
        json.dumps(row(2)),
        "torn {",
        json.dumps(row(3)),
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(old) + "\n")
    RunLog(tmp_path).truncate_after(2)
    assert (tmp_path / "metrics.jsonl").read_text() == old[0] + "\n" + old[1] + "\n"


@pytest.mark.parametrize("run", ["ptb-fedmed-c0.5", "ptb-central-c0.5"])
def test_an_archived_run_folder_loads(run):
    """A run folder written before RoundRecord existed: every line reads back to its own bytes."""
    folder = read_run(OLD_RUNS / run)
    assert [r.round for r in folder.rounds] == list(range(1, 13))
    assert folder.malformed_lines == 0 and folder.duplicate_rounds == 0
    assert (
        folder.summary["rounds_completed"] == 12 and folder.config.get("rounds", 12) == 12
    )  # central: no config
    best = min(folder.rounds, key=lambda r: r.valid)
    assert (best.round, best.valid) == (folder.summary["best_round"], folder.summary["best_valid"])
    lines = (OLD_RUNS / run / "metrics.jsonl").read_text().splitlines()
    if run == "ptb-fedmed-c0.5":  # the engine's rows: written again, the same bytes
        assert lines == [json.dumps(r.to_json(), sort_keys=True) for r in folder.rounds]
        assert {r.strategy for r in folder.rounds} <= {"fedmed", "fedavg"} and all(
            r.weights for r in folder.rounds
        )
    else:  # the centralized baseline's rows: its own keys kept
        assert [{k: r.to_json()[k] for k in json.loads(line)} for line, r in zip(lines, folder.rounds)] == [
            json.loads(line) for line in lines
        ]


def test_an_unusable_run_folder_is_one_line(tmp_path):
    with pytest.raises(RunFolderError, match="run folder not found"):
        read_run(tmp_path / "nope")
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n')
    (tmp_path / "summary.json").write_text("[1]")
    with pytest.raises(RunFolderError, match=r"summary.json must hold a JSON object, not list$"):
        read_run(tmp_path)


def test_resume_keeps_its_error_lines(tmp_path):
    with pytest.raises(
        UsageError, match=f"^--resume needs an existing run folder; {tmp_path} has no config.json$"
    ):
        check(tmp_path, resume=True)
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(UsageError, match=r"^--resume: .*config.json is not a run config \(a JSON object\)$"):
        check(tmp_path, resume=True)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(
        UsageError,
        match=r"^--resume: cannot read .*config.json \(Expecting property name enclosed in "
        r"double quotes: line 1 column 2 \(char 1\)\); the run cannot be rebuilt",
    ):
        check(tmp_path, resume=True)
    (tmp_path / "config.json").write_text('{"rounds": 3}')
    assert check(tmp_path, resume=True) == {"rounds": 3}
    with pytest.raises(UsageError, match=r"already holds a run \(config.json\); pass --resume"):
        check(tmp_path, resume=False)
