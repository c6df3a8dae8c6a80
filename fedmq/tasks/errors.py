"""Typed errors a user can cause through task options or data folders."""

from fedmq.errors import FedmqError


class TaskError(FedmqError):
    """A task option or data folder is wrong; the message says what and how to fix it (one line)."""
