"""Typed errors of the transport."""

from fedmq.errors import FedmqError


class BrokerError(FedmqError):
    """The broker is unreachable, refused an operation, or a publish was not confirmed.

    ``permanent``: trying again cannot help (a malformed URL, credentials or a virtual host the broker
    refuses): agents give up with this one line instead of retrying forever."""

    def __init__(self, message: str = "", *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class Undeliverable(BrokerError):
    """The broker accepted the connection but not this one message: no queue is bound to its routing key
    (returned as unroutable under ``mandatory``), or it was nacked until its deadline. A fault of where it was
    sent (a queue deleted, a queue refusing), not of the connection: a publisher that sends to many queues
    leaves out the one it could not reach and goes on."""
