"""Joining a job, saying who is present and leaving it: what a one-client agent and a host
(client_agent.host) do alike on their connection."""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from fedmq.broker.transport import topology
from fedmq.broker.transport.base import Broker, Subscription
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.wire import messages
from fedmq.broker.wire.envelope import Envelope, Kind
from fedmq.errors import CodecError

log = structlog.get_logger(__name__)


def join(
    connect: Callable[[], Broker],
    job: str,
    owner: str,
    stop: threading.Event,
    hello: Callable[[Broker], None],
) -> tuple[Broker, Subscription] | None:
    """Connect, declare ``owner``'s two queues (announcements, control), consume them and say ``hello`` (the
    online presence) over the new connection; None once ``stop`` is set.

    A failure is retried after 0.2 s, doubling up to 10 s; one the broker gives for good (a bad URL, refused
    credentials) is raised. A half-joined connection is closed: its consumers would otherwise take (and
    lose) the owner's deliveries."""
    delay = 0.2
    while not stop.is_set():
        broker = None
        try:
            broker = connect()
            broker.declare_job(job, [owner], inbox=False)
            events = broker.subscribe(topology.q_latest(job, owner), prefetch=1)
            events.add(topology.q_control(job, owner), prefetch=16)
            hello(broker)
            return broker, events
        except BrokerError as exc:
            if broker is not None:
                try:
                    broker.close()
                except Exception as close_exc:  # already broken: nothing more to release
                    log.debug("closing a failed join", error=str(close_exc))
            if exc.permanent:
                raise
            log.warning("cannot join, retrying", owner=owner, error=str(exc), delay=delay)
            stop.wait(delay)
            delay = min(delay * 2, 10.0)
    return None


def leave(broker: Broker | None, goodbye: Callable[[Broker], None] | None) -> None:
    """Close ``broker``, first saying ``goodbye`` (the offline presence) when given; a goodbye that cannot be
    sent is not an error (the aggregator's horizon notices the silence)."""
    if broker is None:
        return
    if goodbye is not None:
        try:
            goodbye(broker)
        except BrokerError:
            pass
    broker.close()


def publish_presence(
    broker: Broker, job: str, owner: str, env: Envelope, timeout: float | None = None
) -> None:
    """Publish ``env``, a presence of ``owner`` (a client or a host), on the job's presence key for it."""
    broker.publish(
        topology.rk_presence(job, owner), messages.encode(env), message_id=env.msg_id, timeout=timeout
    )


# what an agent's (or host's) queues carry: a round's steps after its announcement (a grant, secure
# aggregation's) and the job's end
ROUND_STEPS = (Kind.GRANT, Kind.SECAGG_COHORT, Kind.SECAGG_INBOX, Kind.SECAGG_UNMASK)
AGENT_EVENTS = (Kind.ANNOUNCE, *ROUND_STEPS, Kind.END)


def decode_event(body: bytes, job: str) -> Envelope:
    """An announcement, grant or end of ``job`` from an owner's queues; CodecError for anything else."""
    env = messages.decode(body)
    if env.job != job or env.kind not in AGENT_EVENTS:
        raise CodecError("unexpected", f"{env.kind.value} for job {env.job}")
    return env
