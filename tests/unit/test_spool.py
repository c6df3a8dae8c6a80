"""The round spool keeps updates as they came, hands out their keys, and reads one at a time."""

from __future__ import annotations

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
