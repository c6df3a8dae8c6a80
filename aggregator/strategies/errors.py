"""Typed errors of the aggregator's own: stale asynchronous updates and checkpoints (one-line messages)."""

from __future__ import annotations

from fedmq.errors import FedmqError, StrategyError


class StaleUpdate(StrategyError):
    """Asynchronous mode: the update's staleness exceeds ``max_staleness``; it was dropped,
    nothing changed."""

    def __init__(self, staleness: int, max_staleness: int, client: str = "") -> None:
        self.staleness = staleness
        self.max_staleness = max_staleness
        self.client = client
        who = f" from {client!r}" if client else ""
        super().__init__(f"update{who} is {staleness} versions stale (max {max_staleness}); dropped")


class CheckpointError(FedmqError):
    """A checkpoint could not be written or its contents are not what fedmq writes."""
