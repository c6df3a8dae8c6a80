"""What a command's process sets up before it runs: its logs, its allocator and torch, its task."""

from __future__ import annotations

import os
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


def reproducible_blas() -> None:
    """Intel MKL, torch's CPU BLAS, may differ in the last bits of a matrix product from one run to the next
    unless its Conditional Numerical Reproducibility mode is on; a seeded run promises the same bits
    (docs/cli.md, Reproducibility). MKL reads the mode at its first call, so this comes before any training;
    a value the user set is kept."""
    os.environ.setdefault("MKL_CBWR", "AUTO")


def prepare_process() -> None:
    """For a process that serves or simulates: it moves model-sized buffers all the time, so glibc may reuse
    them (broker/wire/malloc.py); it trains, so torch's optimizers leave torch._dynamo unloaded
    (fedmq/tasks/lazy_dynamo.py: ~1.8 s of CPU at every start), and MKL keeps its results reproducible."""
    from fedmq.broker.wire.malloc import tune_allocator
    from fedmq.tasks import lazy_dynamo

    reproducible_blas()
    tune_allocator()
    lazy_dynamo.defer()


def make_task(options: dict[str, Any]) -> Any:
    from fedmq.tasks.registry import make_task

    opts = dict(options)
    return make_task(opts.pop("task"), **opts)
