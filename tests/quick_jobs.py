"""The job settings of a federation of a few tiny in-process clients that runs in seconds: every client each
round, two local steps of batch 4 at lr 1, a half-second heartbeat, 20 s to join and 30 s deadlines. A test
sets what it is about on top: ``quick_job("name", clients=3, strategy="async", ...)``."""

from __future__ import annotations

from typing import Any

from fedmq.aggregator.config import JobConfig

QUICK: dict[str, Any] = dict(
    fraction=1.0,
    lr=1.0,
    max_steps=2,
    batch_size=4,
    heartbeat_s=0.5,
    join_timeout_s=20,
    report_deadline_s=30,
    update_deadline_s=30,
)


def quick_job(job: str, **settings: Any) -> JobConfig:
    """QUICK with ``settings`` over it."""
    return JobConfig(job=job, **{**QUICK, **settings})
