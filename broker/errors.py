"""Typed errors of the transport and wire format."""


class FedmqError(Exception):
    """Base of every error fedmq raises on purpose; its message is one line for the user."""


class CodecError(FedmqError):
    """A message could not be encoded or was rejected while decoding.

    ``reason`` is a short stable slug (e.g. ``"bad-digest"``, ``"shape-mismatch"``) used as a metric label.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class BrokerError(FedmqError):
    """The broker is unreachable, refused an operation, or a publish was not confirmed.

    ``permanent``: trying again cannot help (a malformed URL, credentials or a virtual host the broker refuses):
    agents give up with this one line instead of retrying forever."""

    def __init__(self, message: str = "", *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent
