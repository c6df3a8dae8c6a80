"""The CLI's own error types (torch-free, so flag checks can raise it before anything heavy is imported)."""

from typing import Any

from fedmq.errors import FedmqError


class UsageError(FedmqError):
    """A bad command line, option value, config file or run folder: one line, exit code 2."""


class Stopped(FedmqError):
    """SIGTERM while a service was connecting (starting, or an agent rejoining): exit code 143."""

    exit_code = 143


class NoRoundCompleted(FedmqError):
    """A job that ended by itself without completing a round (every round skipped: no agent reported, every
    update refused …): it failed, though nothing crashed. Exit code 1."""

    exit_code = 1


def check_progress(summary: dict[str, Any]) -> None:
    """Raise NoRoundCompleted with the engine's line when the run's summary says no round completed."""
    line = summary.get("no_round_completed")
    if line:
        raise NoRoundCompleted(str(line))
