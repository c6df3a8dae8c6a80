"""Typed errors of the transport."""

from fedmq.errors import FedmqError


class BrokerError(FedmqError):
    """The broker is unreachable, refused an operation, or a publish was not confirmed.

    ``permanent``: trying again cannot help (a malformed URL, credentials or a virtual host the broker
    refuses): agents give up with this one line instead of retrying forever."""

    def __init__(self, message: str = "", *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent
