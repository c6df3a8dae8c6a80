"""fedmq.files: a file is replaced whole or not at all, and two writers of one file do not mix."""

from __future__ import annotations

import os

import pytest

from fedmq import files
from fedmq.files import append_line, replacing, write_atomic


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "results.md"
    path.write_text("old")
    write_atomic(path, "new ✓")
    write_atomic(tmp_path / "blob", b"\x00\xff")
    assert path.read_text(encoding="utf-8") == "new ✓"
    assert (tmp_path / "blob").read_bytes() == b"\x00\xff"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blob", "results.md"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="crashed"):
        with replacing(path, text=True) as fh:
            fh.write("half of the new")
            raise RuntimeError("crashed mid-write")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_two_writers_of_one_file_each_have_their_own_temporary(tmp_path):
    path = tmp_path / "results.md"
    with replacing(path, text=True) as first:
        first.write("first, ")
        with replacing(path, text=True) as second:  # a second process's table, written meanwhile
            second.write("second whole")
        first.write("whole")
        assert path.read_text() == "second whole"  # readers see one whole table, never a mix
    assert path.read_text() == "first, whole"
    assert [p.name for p in tmp_path.iterdir()] == ["results.md"]


def test_text_mode_keeps_line_ends_as_written(tmp_path):
    path = tmp_path / "metrics.csv"
    with replacing(path, text=True) as fh:
        fh.write("a,b\r\n1,2\r\n")  # the csv module's line ends
    assert path.read_bytes() == b"a,b\r\n1,2\r\n"


def test_durable_fsyncs_the_file_and_its_folder(tmp_path, monkeypatch):
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(files.os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    write_atomic(tmp_path / "round.json", b"{}")
    assert synced == []
    write_atomic(tmp_path / "round.json", b"{}", durable=True)
    assert len(synced) == 2  # the new file, then the folder entry that names it


def test_private_files_are_the_owners_alone_from_the_moment_they_exist(tmp_path):
    path = tmp_path / "creds.json"
    with replacing(path, text=True, private=True) as fh:
        fh.write("{}")
        (tmp,) = [p for p in tmp_path.iterdir()]  # the temporary, before it becomes creds.json
        assert tmp.stat().st_mode & 0o077 == 0
    assert path.stat().st_mode & 0o777 == 0o600
    write_atomic(tmp_path / "report.md", "x")
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "report.md").stat().st_mode & 0o777 == 0o666 & ~umask  # an ordinary file otherwise


def test_append_line_adds_one_line_and_a_durable_one_is_fsynced(tmp_path, monkeypatch):
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(files.os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    path = tmp_path / "reports.jsonl"
    append_line(path, b"one\n")
    assert synced == []
    append_line(path, b"two\n", durable=True)
    assert len(synced) == 1  # the file: its folder already named it
    append_line(tmp_path / "new.jsonl", b"x\n", durable=True)
    assert len(synced) == 3  # a new file, and the folder entry that names it
    assert path.read_bytes() == b"one\ntwo\n"


@pytest.mark.parametrize("durable", [False, True])
def test_a_reused_file_is_written_over_in_place_and_cut_to_the_new_content(tmp_path, monkeypatch, durable):
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(files.os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    old = tmp_path / "old.msg"
    old.write_bytes(b"x" * 100)
    with old.open("rb") as held:  # open on the old file: it sees the new bytes, written into that very file
        write_atomic(tmp_path / "new.msg", b"short", reuse=old, durable=durable)
        assert held.read() == b"short"
    assert (tmp_path / "new.msg").read_bytes() == b"short"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.msg"]
    assert len(synced) == (2 if durable else 0)  # the file and its folder, as without reuse
    write_atomic(tmp_path / "newer.txt", "longer than before ✓", reuse=tmp_path / "new.msg")
    assert (tmp_path / "newer.txt").read_text(encoding="utf-8") == "longer than before ✓"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newer.txt"]


def test_a_file_with_another_link_is_not_reused(tmp_path):
    old = tmp_path / "old.msg"
    old.write_bytes(b"kept")
    os.link(old, tmp_path / "backup.msg")  # a snapshot's hard link must not change
    write_atomic(tmp_path / "new.msg", b"data", reuse=old)
    assert (tmp_path / "backup.msg").read_bytes() == b"kept" and old.read_bytes() == b"kept"
    assert (tmp_path / "new.msg").read_bytes() == b"data"


def test_reuse_is_refused_for_a_private_file_or_the_file_replaced(tmp_path):
    old = tmp_path / "old.msg"
    old.write_bytes(b"kept")
    with pytest.raises(ValueError, match="reuse"):
        write_atomic(tmp_path / "secret", b"k", private=True, reuse=old)
    with pytest.raises(ValueError, match="reuse"):
        write_atomic(old, b"k", reuse=old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.msg"] and old.read_bytes() == b"kept"


def test_a_reused_file_that_is_gone_gives_a_new_one(tmp_path):
    write_atomic(tmp_path / "new.msg", b"data", reuse=tmp_path / "taken-by-another-writer.msg")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.msg"]
    assert (tmp_path / "new.msg").read_bytes() == b"data"


def test_a_failed_write_over_a_reused_file_keeps_the_old_target(tmp_path):
    (tmp_path / "f").write_bytes(b"before")
    old = tmp_path / "old.msg"
    old.write_bytes(b"x" * 10)
    with pytest.raises(RuntimeError), replacing(tmp_path / "f", reuse=old) as fh:
        fh.write(b"half")
        raise RuntimeError("crash")
    assert (tmp_path / "f").read_bytes() == b"before"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # the reused file went with the temporary
