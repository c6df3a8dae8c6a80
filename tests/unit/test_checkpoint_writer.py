"""The checkpoint writer: one write at a time, in order, off the caller's thread; a failed write raised once
in the caller's thread."""

from __future__ import annotations

import threading

import pytest

from fedmq.aggregator.checkpoint_writer import CheckpointWriter


def test_a_write_runs_off_the_callers_thread_and_the_next_waits_for_it():
    writer, order = CheckpointWriter(), []
    release = threading.Event()
    started = threading.Event()

    def first():
        started.set()
        release.wait()
        order.append(("first", threading.current_thread() is threading.main_thread()))

    writer.submit(first)
    assert started.wait(30)
    assert order == []  # submit returned while the write is still going on
    second_submitted = threading.Event()

    def submit_second():
        writer.submit(lambda: order.append(("second", False)))
        second_submitted.set()

    t = threading.Thread(target=submit_second)
    t.start()
    assert not second_submitted.wait(0.2)  # waits for the first write to finish
    release.set()
    t.join(30)
    writer.wait()
    assert order == [("first", False), ("second", False)]


def test_a_failed_write_is_raised_once_at_the_next_submit_and_that_write_is_not_started():
    writer, ran = CheckpointWriter(), []

    def full_disk():
        raise OSError("No space left on device")

    writer.submit(full_disk)
    with pytest.raises(OSError, match="No space left"):
        writer.submit(lambda: ran.append(1))
    assert ran == []
    writer.wait()  # raised once: nothing pending now
    writer.submit(lambda: ran.append(2))
    writer.wait()
    assert ran == [2]


def test_join_keeps_the_error_for_wait():
    writer = CheckpointWriter()
    writer.submit(lambda: 1 / 0)
    writer.join()
    with pytest.raises(ZeroDivisionError):
        writer.wait()
