"""Typed errors of the transport, and the count of permission refusals that makes one permanent."""

import threading

from fedmq.errors import FedmqError

REFUSAL_TRIES = 5  # refusals of one operation (403 ACCESS_REFUSED) in a row before it is permanent


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


class _Refusals:
    """Permission refusals (403) in a row per (user, operation), for the whole process: an agent opens a new
    connection each time it joins again, and a refusal that outlives REFUSAL_TRIES of them is permanent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    def note(self, user: str, what: str) -> int:
        with self._lock:
            n = self._counts.get((user, what), 0) + 1
            self._counts[(user, what)] = n
            return n

    def clear(self, user: str, what: str) -> None:
        if self._counts:
            with self._lock:
                self._counts.pop((user, what), None)


REFUSALS = _Refusals()


def refusal(user: str, what: str, text: str) -> BrokerError:
    """The error for a permission refusal of ``what`` (an operation: a routing key published, a job
    declared) to ``user``: retryable for the first REFUSAL_TRIES - 1 refusals in a row, then permanent (one
    line saying what to fix), so an agent whose permissions refuse it for good stops instead of retrying
    forever."""
    n = REFUSALS.note(user, what)
    if n >= REFUSAL_TRIES:
        return BrokerError(
            f"{text}: refused {n} times in a row, so user {user!r} is not permitted to: "
            "fix its permissions (fedmq broker provision) and start it again",
            permanent=True,
        )
    return BrokerError(f"{text} (refusal {n} of {REFUSAL_TRIES} before giving up)")
