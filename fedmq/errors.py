"""The errors fedmq raises on purpose, shared by every layer: one-line messages for the user."""


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


class StrategyError(FedmqError):
    """An update does not fit the aggregation (unknown tensor, wrong shape, non-finite values, bad state)."""


class BadParameter(StrategyError):
    """A strategy, mediator or pulling parameter is out of range or unknown."""


class SecAggError(FedmqError):
    """Secure aggregation refused or detected a fault (fedmq/secagg): too few shares, a share or vector that
    fails its check, a parameter out of range. ``reason`` is a short stable slug (e.g. ``"too-few-shares"``,
    ``"bad-share"``, ``"bad-length"``); the message names the clients concerned where the protocol can."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"secure aggregation: {reason}: {detail}")
