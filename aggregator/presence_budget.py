"""Each sender's budget of presence messages: one agent or host flooding the inbox with presence cannot
make anyone else's messages wait behind its own.

Presence shares the job's inbox (one FIFO queue) with reports and updates. A sender -- the AMQP user
RabbitMQ validated, or under a shared identity the client or host its routing key names -- may send
``allowance(sender)`` presence messages in each window (the presence horizon: three heartbeats); the rest are
acked unread, before any decoding, and counted (the inbox's ``presence-over-budget``, and per sender in the
engine's status). The first message over budget in a window names its sender in one log line. An honest agent
beats three times a window; see docs/reliability.md for why the budget is not a separate queue."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import structlog

from fedmq.broker.transport import topology
from fedmq.broker.transport.base import Delivery

log = structlog.get_logger(__name__)

# presence messages an agent may send in a window: three beats, going offline and back, and room to spare
PER_WINDOW = 12


class PresenceBudget:
    """Admits at most ``allowance(sender)`` presence messages per sender and window (see module docstring)."""

    def __init__(
        self,
        window_s: float,
        allowance: Callable[[str], int] = lambda sender: PER_WINDOW,
        shared: bool = False,
    ) -> None:
        self.window_s = window_s
        self.allowance = allowance
        self.shared = shared
        self.over: Counter[str] = Counter()  # sender -> presence messages dropped over its budget, in all
        self._counts: Counter[str] = Counter()  # sender -> presence messages in this window
        self._named: set[str] = set()  # senders logged as over budget in this window
        self._window_end = 0.0

    def sender(self, delivery: Delivery) -> str:
        """Whose budget ``delivery`` counts against: its validated user, or (a shared identity, where every
        agent is one user) the client or host its routing key names."""
        if self.shared or not delivery.user_id:
            return delivery.routing_key.rpartition(".")[2]
        return delivery.user_id

    def admit(self, delivery: Delivery) -> bool:
        """False for a presence message over its sender's budget (the caller acks it unread)."""
        if not topology.is_presence(delivery.routing_key):
            return True
        now = time.monotonic()
        if now >= self._window_end:
            self._counts.clear()
            self._named.clear()
            self._window_end = now + self.window_s
        sender = self.sender(delivery)
        self._counts[sender] += 1
        n = self._counts[sender]
        if n <= PER_WINDOW or n <= self.allowance(sender):
            return True
        self.over[sender] += 1
        if sender not in self._named:
            self._named.add(sender)
            log.warning(
                "presence over its sender's budget: dropped unread for the rest of the window",
                sender=sender,
                allowance=self.allowance(sender),
                window_s=self.window_s,
            )
        return False
