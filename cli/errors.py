"""The CLI's own error type (torch-free, so flag checks can raise it before anything heavy is imported)."""

from fedmq.errors import FedmqError


class UsageError(FedmqError):
    """A bad command line, option value, config file or run folder: one line, exit code 2."""


class Stopped(FedmqError):
    """SIGTERM while a service was connecting (starting, or an agent rejoining): exit code 143."""

    exit_code = 143
