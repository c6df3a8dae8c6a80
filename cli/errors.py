"""The CLI's own error type (torch-free, so flag checks can raise it before anything heavy is imported)."""

from broker.errors import FedmqError


class UsageError(FedmqError):
    """A bad command line, option value, config file or run folder: one line, exit code 2."""
