"""The aggregator's inbox: decode, check identity and job, count and log every rejection."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

import structlog

from fedmq.aggregator.presence_budget import PresenceBudget
from fedmq.broker.transport import topology
from fedmq.broker.transport.base import Broker, Delivery, ReassemblyLimits, Subscription
from fedmq.broker.transport.queues import message_chunks
from fedmq.broker.wire import messages
from fedmq.broker.wire.chunk_frames import DEFAULT_CHUNK_LIMIT
from fedmq.broker.wire.envelope import Envelope, Kind, Limits
from fedmq.errors import CodecError, FedmqError

log = structlog.get_logger(__name__)

AGENT_KINDS = (Kind.PRESENCE, Kind.REPORT, Kind.UPDATE)
# what agents send besides under secure aggregation (aggregator.secure_round): only a secure job takes it
SECURE_KINDS = (Kind.SECAGG_KEYS, Kind.SECAGG_SHARES, Kind.MASKED, Kind.SECAGG_ANSWER)
# what the aggregators of one job say to each other (two-tier aggregation): only from their own broker user
TIER_KINDS = (Kind.EDGE_ROUND, Kind.PARTIAL, Kind.END)
ROOT_KINDS = (*AGENT_KINDS, Kind.PARTIAL)
EDGE_KINDS = (Kind.UPDATE, Kind.EDGE_ROUND, Kind.END)


MAX_PREFETCH = 65535  # AMQP's prefetch-count is a 16-bit field
# messages of one client that secure buffers hold unacked (aggregator.secure_buffers): its check-in, that
# check-in's report, and the report of its next check-in on its way
HELD_A_CLIENT = 3


def upload_prefetch(broker: Broker, message_bound: int, uploaders: int) -> int:
    """A consumer's prefetch sized to a round's uploads: every chunk of every uploader's update can be in
    flight. A smaller window would make the broker layer ack chunks before their message is complete (to
    avoid a deadlock), and a crash of this process would then lose those partially received, confirmed
    updates."""
    chunk_limit = getattr(broker, "chunk_limit", DEFAULT_CHUNK_LIMIT)
    per_update = message_chunks(message_bound, chunk_limit)
    return min(MAX_PREFETCH, max(64, uploaders * per_update + 16))


def upload_reassembly(max_message_bytes: int, uploaders: int) -> ReassemblyLimits:
    """Bounds on incomplete chunked updates: one is at most one update message; a sender (routing key, i.e.
    agent) may have two pending (a restarted agent's new upload beside its dead partial one); all together,
    two more than the agents that may upload at once."""
    m = max_message_bytes
    return ReassemblyLimits(
        max_message_size=m, max_pending_bytes=(uploaders + 2) * m, max_pending_per_sender=2 * m
    )


@dataclass
class Received:
    env: Envelope
    delivery: Delivery
    size: int


class Inbox:
    """Takes the job's inbox deliveries for the engine thread through a Subscription, validates them.

    identity: "strict" — the AMQP user_id must equal the client id the message claims (each agent has its own
    broker user), or be the user of the host the client is named for (a host's user speaks for its clients
    ``<host>-<n>``; a roster only from that user); "shared:USER" — every agent connects as USER (simulate
    over a shared guest account).
    ``limits``: size bounds for decoding (the engine derives them from the job's manifest). ``kinds``: what
    may come (an edge aggregator's queue: updates and the root's edge-round); a tier message (TIER_KINDS)
    must come from this aggregator's own broker user, which the root and its edges share.
    """

    def __init__(
        self,
        broker: Broker,
        job: str,
        identity: str = "strict",
        limits: Limits | None = None,
        kinds: tuple[Kind, ...] = ROOT_KINDS,
    ) -> None:
        self.broker = broker
        self.job = job
        self.kinds = kinds
        self.identity = identity
        self.limits = limits or Limits()
        self.rejected: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self._sub: Subscription | None = None
        self._head: Delivery | None = None  # a delivery taken by wait_first, handed out first by next
        self._taken = 0  # deliveries taken from the subscription (see mark)
        self.budget: PresenceBudget | None = None  # each sender's presence budget (the engine's)
        # deliveries handed out by ``next`` and not settled yet: the engine holds their bodies in memory
        self._out: set[int] = set()
        self.held_peak = 0  # the most of them at once

    def subscribe(
        self, queue: str, *, prefetch: int | None = None, reassembly: ReassemblyLimits | None = None
    ) -> str:
        """Start consuming ``queue`` (the job's inbox); the consumer tag (Broker.cancel stops it)."""
        self._sub = self.broker.subscribe(queue, prefetch=prefetch, reassembly=reassembly)
        return self._sub.tags[0]

    def left(self) -> int | None:
        """Messages left in the job's inbox at the job's end (late presence and reports), said in the log with
        how to remove them; None when the broker cannot tell."""
        inbox = topology.q_inbox(self.job)
        try:
            left = self.broker.queue_depth(inbox)
        except FedmqError as exc:
            log.warning("could not count the messages left in the inbox", queue=inbox, error=str(exc))
            return None
        if left:
            log.info(
                f"{left} message(s) left in the job's inbox: fedmq broker purge --job {self.job} "
                "removes them (fedmq broker deprovision also the job's users)",
                queue=inbox,
            )
        return left

    def _subscription(self) -> Subscription:
        if self._sub is None:
            raise RuntimeError("Inbox.subscribe first")
        return self._sub

    def wait_first(self, stop: threading.Event, poll: float = 0.5) -> bool:
        """Block until a delivery is waiting (we are the active consumer) or ``stop`` is set;
        True if one is."""
        while not stop.is_set():
            if self._head is None:
                self._head = self._subscription().next(poll)
            if self._head is not None:
                return True
        return False

    def backlog(self) -> int:
        """Deliveries queued now (not yet read with ``next``)."""
        return self._subscription().qsize() + (self._head is not None)

    def mark(self) -> int:
        """A mark past every delivery queued now: ``drained(mark)`` once each of them has been taken."""
        return self._taken + self.backlog()

    def drained(self, mark: int) -> bool:
        return self._taken >= mark

    def _take(self, timeout: float) -> Delivery | None:
        """The next delivery within ``timeout``; presence over its sender's budget is acked unread on the way
        (before any decoding: a flood costs the engine as little as can be)."""
        end = time.monotonic() + max(timeout, 0.0)
        while True:
            delivery, self._head = self._head, None
            if delivery is None:
                delivery = self._subscription().next(max(end - time.monotonic(), 0.0))
                if delivery is None:
                    return None
            self._taken += 1
            if self.budget is None or self.budget.admit(delivery):
                return delivery
            self.dropped["presence-over-budget"] += 1
            self.broker.ack(delivery)

    def next(self, timeout: float) -> Received | None:
        """The next valid message, or None when ``timeout`` passes. Invalid ones are rejected on the way."""
        delivery = self._take(timeout)
        if delivery is None:
            return None
        try:
            env = messages.decode(delivery.body, limits=self.limits)
            self._check(env, delivery)
        except CodecError as exc:
            self.reject(delivery, exc.reason, str(exc))
            return None
        except Exception as exc:  # a decoder bug must never stop the aggregator: reject, count, log
            self.reject(delivery, "undecodable", f"{type(exc).__name__}: {exc}")
            return None
        self._out.add(id(delivery))
        self.held_peak = max(self.held_peak, len(self._out))
        return Received(env, delivery, len(delivery.body))

    def held(self) -> int:
        """Deliveries handed out by ``next`` and not yet acked, dropped or rejected."""
        return len(self._out)

    def _check(self, env: Envelope, delivery: Delivery) -> None:
        if env.job != self.job:
            raise CodecError("wrong-job", f"message for job {env.job!r}")
        if env.kind not in self.kinds:
            raise CodecError("unexpected-kind", f"{env.kind.value} is not sent here")
        user = delivery.user_id
        if not user:
            raise CodecError("no-user-id", "message carries no AMQP user_id")
        if env.kind in TIER_KINDS:
            if user != self.broker.user:
                raise CodecError("identity-mismatch", f"user {user!r} is not this job's aggregator")
            return
        if self.identity.startswith("shared:"):
            ok = user == self.identity.partition(":")[2]
        elif env.kind is Kind.PRESENCE and "clients" in env.payload:  # a host: only its own user
            ok = topology.is_host_user(user, self.job, env.client)
        else:  # the job's provisioned user for that client, a user named for the client, or its host's user
            # (a client <host>-<n> is named for its host: its host's user speaks for it even before the
            # host's roster is known, as after a restart of the aggregator)
            ok = user in (env.client, f"{self.job}.{env.client}") or topology.is_host_user(
                user, self.job, topology.host_of(env.client)
            )
        if not ok:
            raise CodecError("identity-mismatch", f"user {user!r} claims to be client {env.client!r}")

    def reject(self, delivery: Delivery, reason: str, detail: str = "") -> None:
        """A malformed or forged message: reject without requeue, count, log."""
        self.count_rejection(reason, detail, delivery.routing_key)
        self._out.discard(id(delivery))
        self.broker.reject(delivery, requeue=False)

    def refuse(self, received: Received | None, parked: bool, reason: str, detail: str = "") -> None:
        """A bad update (or partial sum) the engine took: rejected while its delivery is live, only counted
        when it was acked already (``parked``: spooled ahead of its turn); read from an earlier run's spool,
        neither."""
        if received is not None:
            self.reject(received.delivery, reason, detail)
        elif parked:
            self.count_rejection(reason, detail)

    def count_rejection(self, reason: str, detail: str = "", routing_key: str = "") -> None:
        """Count and log a rejected message; ``reject`` also settles its delivery (one acked already, as an
        update spooled ahead of its turn, is only counted)."""
        self.rejected[reason] += 1
        log.warning("message rejected", reason=reason, detail=detail[:200], routing_key=routing_key)

    def drop(self, received: Received, reason: str) -> None:
        """A valid message that is of no use (stale round, duplicate, not granted): ack, count, log."""
        self.dropped[reason] += 1
        env = received.env
        log.info(
            "message dropped",
            reason=reason,
            kind=env.kind.value,
            client=env.client,
            round=env.round,
            msg_id=env.msg_id,
        )
        self.ack(received)

    def ack(self, received: Received) -> None:
        self._out.discard(id(received.delivery))
        self.broker.ack(received.delivery)
