"""What the service commands (aggregator run, agent run) share: the job file, the broker URL with its
credentials, the metrics endpoint."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fedmq.aggregator.config import JobFile, read_job_file


def job_file(path: Path | None) -> JobFile:
    """The --config job file (aggregator.config.read_job_file), or an empty one."""
    return read_job_file(path) if path is not None else JobFile(Path(), {}, {})


def merge(file_values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """Flags and FEDMQ_* environment variables (already folded in by Typer) override the config file."""
    merged = dict(file_values)
    merged.update({k: v for k, v in given.items() if v is not None})
    return merged


def broker_url(url: str, user: str | None, password: str | None) -> str:
    """Combine a URL with credentials from FEDMQ_BROKER_USER / FEDMQ_BROKER_PASSWORD (Kubernetes Secrets)."""
    if not user:
        return url
    from fedmq.broker.transport.urls import with_credentials

    return with_credentials(url, user, password or "")


def metrics_endpoint(port: int, status: Callable[[], dict[str, Any]], ready: Callable[[], bool]) -> Any:
    """The --metrics-port endpoint (cli/telemetry.py), not serving yet; None when the port is 0."""
    if not port:
        return None
    from fedmq.cli.telemetry import Telemetry

    return Telemetry(status, ready)


@contextlib.contextmanager
def serving(telemetry: Any, port: int) -> Iterator[None]:
    """Serve ``telemetry`` (when there is one) on ``port`` while the service runs."""
    if telemetry:
        telemetry.serve(port)
    try:
        yield
    finally:
        if telemetry:
            telemetry.close()
