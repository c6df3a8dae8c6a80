"""What a command's process sets up before it runs: its logs, its allocator and torch, its task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedmq.cli.errors import UsageError


def setup_logs(
    level: str, fmt: str = "auto", file: Path | None = None, console_level: str | None = None
) -> None:
    from fedmq.cli.logs import configure

    try:
        configure(level, fmt, file, console_level)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def prepare_process() -> None:
    """For a process that serves or simulates: it moves model-sized buffers all the time, so glibc may reuse
    them (broker/wire/malloc.py); it trains, so torch's optimizers leave torch._dynamo unloaded
    (fedmq/tasks/lazy_dynamo.py: ~1.8 s of CPU at every start)."""
    from fedmq.broker.wire.malloc import tune_allocator
    from fedmq.tasks import lazy_dynamo

    tune_allocator()
    lazy_dynamo.defer()


def make_task(options: dict[str, Any]) -> Any:
    from fedmq.tasks.registry import make_task

    opts = dict(options)
    return make_task(opts.pop("task"), **opts)
