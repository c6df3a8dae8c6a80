"""The round spool keeps updates as they came, hands out their keys, and reads one at a time."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from fedmq.aggregator.spool import RoundSpool


def test_updates_are_kept_as_they_came_and_read_one_at_a_time(tmp_path):
    spool = RoundSpool(tmp_path, durable=False)
    spool.save_state(3, {"selected": ["b", "a"]})
    spool.save_update(3, "b", b"\x00bee")
    spool.save_update(3, "a", b"ay")
    state, keys = spool.load(3)
    assert state == {"selected": ["b", "a"], "online": []}
    assert keys == ["a", "b"]
    assert spool.read_update(3, "b") == b"\x00bee"
    spool.drop_update(3, "b")
    assert spool.load(3)[1] == ["a"] and spool.read_update(3, "b") is None
    assert spool.load(4) == (None, [])
    spool.clear_upto(3)
    assert spool.load(3) == (None, [])


@pytest.mark.parametrize("key", ["../x", "", "a/b", "x" * 81])
def test_a_key_that_could_leave_the_round_folder_is_refused(tmp_path, key):
    spool = RoundSpool(tmp_path, durable=False)
    with pytest.raises(ValueError, match="bad spool key"):
        spool.save_update(1, key, b"x")
    assert not any(tmp_path.rglob("*"))


def test_reports_are_appended_and_load_adds_them_to_the_state(tmp_path):
    spool = RoundSpool(tmp_path, durable=False)
    spool.save_state(2, {"selected": ["a", "b", "c"], "reported": {"a": 1.5}})
    spool.save_report(2, "b", 2.25)
    spool.save_report(2, "c", 3.0)
    state_file = tmp_path / "r000002" / "round.json"
    before = state_file.read_bytes()
    spool.save_report(2, "d", 4.0)
    assert state_file.read_bytes() == before  # a report does not rewrite the round's state
    state, _ = spool.load(2)
    assert state is not None and state["reported"] == {"a": 1.5, "b": 2.25, "c": 3.0, "d": 4.0}


def test_a_report_line_cut_short_by_a_crash_is_skipped(tmp_path):
    spool = RoundSpool(tmp_path, durable=True)
    spool.save_state(1, {"selected": ["a", "b"], "reported": {}})
    spool.save_report(1, "a", 0.5)
    with (tmp_path / "r000001" / "reports.jsonl").open("ab") as fh:
        fh.write(b'7\n["x", "y"]\n["b", 0.')  # damaged lines, then a write the process died in the middle of
    state, _ = spool.load(1)
    assert state is not None and state["reported"] == {"a": 0.5}
    spool.save_report(1, "c", 0.75)  # after the restart: c's report is acked, and must not be lost
    state, _ = spool.load(1)
    assert state is not None and state["reported"] == {"a": 0.5, "c": 0.75}


def test_a_cleared_rounds_update_files_are_written_over_by_the_next_rounds(tmp_path):
    spool = RoundSpool(tmp_path, durable=False)
    for key in ("a", "b", "c"):
        spool.save_update(1, key, b"round one " * 10)
    inodes = {p.stat().st_ino for p in (tmp_path / "r000001").glob("update-*.msg")}
    spool.clear_upto(1)
    assert spool.load(1) == (None, []) and len(list((tmp_path / "free").iterdir())) == 3
    spool.save_update(2, "a", b"two")
    spool.save_update(2, "d", b"round two, d")
    assert spool.read_update(2, "a") == b"two" and spool.read_update(2, "d") == b"round two, d"
    assert {p.stat().st_ino for p in (tmp_path / "r000002").glob("update-*.msg")} <= inodes
    assert spool.load(2)[1] == ["a", "d"] and len(list((tmp_path / "free").iterdir())) == 1
    spool.clear_upto(2)  # two updates in round 2: the free files are capped at two
    assert len(list((tmp_path / "free").iterdir())) == 2
    spool.drop_free()
    assert not (tmp_path / "free").exists()
    spool.save_update(3, "a", b"three")  # nothing left to reuse: a new file
    assert spool.read_update(3, "a") == b"three"


def test_a_process_killed_while_writing_over_a_kept_file_leaves_no_update_behind(tmp_path):
    """A process dies (os._exit, as at a kill -9) half-way through writing round 2's update over round 1's
    kept file: the half-written temporary is hidden, the restarted spool lists no update for round 2 and
    reads none, and the redelivered update is spooled whole."""
    child = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        from fedmq.aggregator import spool as spool_module
        from fedmq.files import replacing

        spool = spool_module.RoundSpool(Path({str(tmp_path)!r}), durable=True)
        spool.save_update(1, "a", b"round one " * 1000)
        spool.clear_upto(1)

        def dies_half_way(path, data, *, durable, reuse):
            with replacing(path, durable=durable, reuse=reuse) as fh:
                fh.write(data[: len(data) // 2])
                fh.flush()
                os._exit(9)

        spool_module.write_atomic = dies_half_way
        spool.save_update(2, "b", b"round two " * 1000)
        """
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == 9, done.stderr
    halves = list((tmp_path / "r000002").glob(".update-b.msg.*.tmp"))
    half = halves[0].read_bytes() if len(halves) == 1 else b""
    assert half == b"round two " * 500 + b"round one " * 500  # it died mid-write over the kept file
    assert not any((tmp_path / "free").iterdir())  # the kept file had become the temporary
    spool = RoundSpool(tmp_path, durable=True)  # the restart
    assert spool.load(2)[1] == [] and spool.read_update(2, "b") is None
    spool.save_update(2, "b", b"round two " * 1000)  # redelivered: never acked before the kill
    assert spool.load(2)[1] == ["b"] and spool.read_update(2, "b") == b"round two " * 1000
