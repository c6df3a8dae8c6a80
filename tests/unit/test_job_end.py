"""What a job's end says: no completed round in one line with its commonest reason, and the messages left in
its inbox."""

from __future__ import annotations

import pytest

from fedmq.aggregator.inbox import Inbox
from fedmq.aggregator.records import RoundRecord, no_round_completed
from fedmq.broker.transport.errors import BrokerError


def _row(rnd: int, reason: str | None) -> RoundRecord:
    return RoundRecord(round=rnd, skipped=reason is not None, skip_reason=reason)


def test_no_round_completed_names_the_commonest_reason_and_the_rejections():
    rows = [_row(1, "nobody online"), _row(2, "0 update(s) < min 1"), _row(3, "0 update(s) < min 1")]
    line = no_round_completed(rows, {"rejected-by-strategy": 4, "bad-digest": 0})
    assert line == (
        "no round completed: all 3 round(s) skipped (2 for 0 update(s) < min 1); "
        "rejected: 4 rejected-by-strategy"
    )
    assert no_round_completed([], {}) == "no round completed: no round was held"
    assert no_round_completed([*rows, _row(4, None)], {}) is None


class _Broker:
    def __init__(self, depth: int | None) -> None:
        self.depth = depth

    def queue_depth(self, queue: str) -> int:
        if self.depth is None:
            raise BrokerError("connection lost")
        return self.depth


@pytest.mark.parametrize("depth", [0, 78, None])
def test_the_inbox_counts_what_is_left(depth):
    assert Inbox(_Broker(depth), "job").left() == depth
