"""The experiments' results files (benchmarks/results_file.py): the ones kept in git under benchmarks/results/
are small, carry no machine's paths and follow the format; a run folder becomes a row, files merge."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fedmq.aggregator.records import RoundRecord
from fedmq.aggregator.runlog import RunLog, write_summary
from fedmq.benchmarks import results_file
from fedmq.benchmarks.experiments import NAMES, SCALES

# the results files and a README.md; commands/ holds those made by command lines, not by a grid
FILES = sorted(p for p in results_file.KEPT.rglob("*") if p.is_file())
KEPT = [p for p in FILES if p.suffix == ".json" and p.parent == results_file.KEPT]
BY_COMMANDS = [p for p in FILES if p.suffix == ".json" and p.parent != results_file.KEPT]
# a string that names a place on one machine: a home, work or temporary folder, or a Windows drive
ABSOLUTE = re.compile(
    r"(?:^|[\s=:,;'\"(\[])(?:/home|/work|/tmp|/root|/Users|/mnt|/var|/opt|/srv)(?:/|\b)|[A-Za-z]:\\"
)


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def test_the_kept_results_files_are_small_and_name_no_machine_paths():
    assert KEPT, "benchmarks/results/ holds the experiments' results files"
    assert sum(p.stat().st_size for p in FILES) <= 1_000_000
    for path in FILES:
        assert path.suffix == ".json" or path.name == "README.md", path.name
        text = path.read_text()
        assert not ABSOLUTE.search(text), f"{path.name}: {ABSOLUTE.search(text).group(0)!r}"
        for s in _strings(json.loads(text)) if path.suffix == ".json" else ():
            assert not ABSOLUTE.search(s), f"{path.name}: {s!r}"


def test_the_path_check_catches_what_it_is_for():
    for bad in ("/home/me/runs", "--out /tmp/exp", '"/work/shared/data/ptb"', "C:\\runs", "x=/root/a"):
        assert ABSOLUTE.search(bad), bad
    for fine in ("ptb", "runs/exp14", "scripts/reproduce.py", "fedmq experiment table2 --scale cpu", "1/3"):
        assert not ABSOLUTE.search(fine), fine


@pytest.mark.parametrize("path", KEPT, ids=[p.name for p in KEPT])
def test_each_kept_file_follows_the_format(path):
    doc = results_file.read(path)
    assert doc["experiment"] in NAMES and doc["scale"] in SCALES
    assert path.name.startswith(f"{doc['experiment']}.{doc['scale']}.") and path.name.endswith(".json")
    assert "--out" not in doc["command"] and doc["runs"]
    assert doc["seeds"] == sorted({r["seed"] for r in doc["runs"]})
    for row in doc["runs"]:
        assert isinstance(row["run"], str) and isinstance(row["seed"], int)
        assert "--out" not in row.get("command", "")
        assert re.fullmatch(r"[0-9a-f]{40}", row.get("commit", doc["commit"])), row["run"]
        if row.get("finished", True):
            assert row["test"] is not None and row["rounds_completed"] >= 1, row["run"]
    assert results_file.dumps(doc) == path.read_text()  # as the writer writes it


@pytest.mark.parametrize("path", BY_COMMANDS, ids=[p.name for p in BY_COMMANDS])
def test_each_file_made_by_command_lines_follows_the_format(path):
    """The same format, but no grid: its experiment and scale name its page's runs, not a grid's cells."""
    doc = results_file.read(path)
    assert path.name == f"{doc['experiment']}.{doc['scale']}.json" and doc["runs"]
    assert doc["seeds"] == sorted({r["seed"] for r in doc["runs"]})
    assert re.fullmatch(r"[0-9a-f]{40}", doc["commit"])
    for row in doc["runs"]:
        assert isinstance(row["run"], str) and isinstance(row["seed"], int)
        if row.get("finished", True):
            assert row["test"] is not None and row["rounds_completed"] >= 1, row["run"]
    assert results_file.dumps(doc) == path.read_text()


def _run_folder(folder: Path, valid: list[float], strategies: list[str], up: list[int]) -> None:
    log = RunLog(folder)
    for i, (v, s, b) in enumerate(zip(valid, strategies, up), 1):
        log.append(
            RoundRecord(
                round=i, strategy=s, valid=v, received=("a", "b"), bytes_up=b, bytes_up_raw=2 * b, wall_s=i
            )
        )
    log.close()
    write_summary(
        folder,
        {"test": 9.5, "best_valid": min(valid), "best_round": 3, "rounds_completed": 3, "run_wall_s": 12.34},
    )


def test_a_run_folder_becomes_a_row_and_the_file_reads_back(tmp_path):
    _run_folder(tmp_path / "r", [30.123456789, 20.0, 10.0], ["fedmed", "fedavg", "fedavg"], [5, 5, 7])
    table_row = {
        "run": "r",
        "strategy": "fedmed",
        "C": 0.5,
        "test": 9.5,
        "valid_curve": [1],
        "bytes_up_per_round": 1,
    }
    row = results_file.run_row(table_row, tmp_path / "r", seed=2)
    assert row["run"] == "r" and row["seed"] == 2 and row["C"] == 0.5 and row["test"] == 9.5
    assert row["valid_curve"] == [30.1235, 20.0, 10.0] and "bytes_up_per_round" not in row
    assert row["strategy_rounds"] == {"fedmed": [1], "fedavg": [2, 3]}
    assert row["bytes_up_raw_by_round"] == [10, 10, 14] and "bytes_down_raw_by_round" not in row
    assert row["round_s_median"] == 2 and "finished" not in row
    cmd = results_file.command_line(
        "topk", "cpu", [0, 1], only="beta0.5", overrides={"fedmed_js": "relative"}
    )
    assert (
        cmd
        == "python scripts/reproduce.py topk --scale cpu --seeds 0,1 --only beta0.5 --set fedmed_js=relative"
    )
    assert results_file.command_line("table2", "cpu", [0]) == "fedmq experiment table2 --scale cpu --seeds 0"
    doc = results_file.document(
        "topk", "cpu", [row | {"test": float("inf")}], cmd, {"fedmed_js": "relative"}, "a" * 40
    )
    path = tmp_path / results_file.file_name("topk", "cpu")
    results_file.write(path, doc)
    assert path.name == "topk.cpu.json"
    back = results_file.read(path)
    assert back["runs"][0]["test"] == "inf" and back["seeds"] == [2] and back["commit"] == "a" * 40
    assert path.read_text().count("\n") == 12  # one key a line, one row a line


def test_an_unfinished_run_is_marked(tmp_path):
    log = RunLog(tmp_path)
    log.append(RoundRecord(round=1, valid=5.0))
    log.close()
    row = results_file.run_row({"run": "x", "test": None, "wall_s": 0.0}, tmp_path, seed=0)
    assert row["finished"] is False and row["rounds_completed"] == 1 and row["wall_s"] is None


def test_merge_keeps_what_a_row_was_made_by():
    def doc(seed, command, commit, overrides):
        return results_file.document(
            "table2", "paper", [{"run": "c", "seed": seed, "test": 1.0}], command, overrides, commit
        )

    merged = results_file.merge(
        [doc(0, "cmd0", "a" * 40, {}), doc(1, "cmd1", "b" * 40, {"amp": True})], command="all"
    )
    assert merged["command"] == "all" and merged["commit"] == "a" * 40 and merged["seeds"] == [0, 1]
    first, second = merged["runs"]
    assert first == {"run": "c", "seed": 0, "test": 1.0, "command": "cmd0"}
    assert second == {
        "run": "c",
        "seed": 1,
        "test": 1.0,
        "command": "cmd1",
        "commit": "b" * 40,
        "overrides": {"amp": True},
    }
    with pytest.raises(ValueError, match="cannot merge"):
        results_file.merge([doc(0, "c", None, {}), results_file.document("sweep", "paper", [], "c")])
