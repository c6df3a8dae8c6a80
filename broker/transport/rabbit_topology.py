"""The RabbitMQ backend's job topology: the jobs it declared, declared again after a reconnect, and the watch
on their exchanges.

Each job has its own exchange (``fedmq.<job>``, broker.transport.topology.exchange). The broker watches it:
the aggregator's side (a job declared with its inbox) checks every ``exchange_check_s`` that it exists,
an agent's side too; a missing exchange is one error line naming it. The aggregator's side declares it
again, with its inbox's bindings, once it has been missing for ``3 * exchange_check_s`` (long enough for
every agent's check to have seen it gone); an agent's side binds its own queues again as soon as it is
back. An agent's publish to it meanwhile fails with that line; the aggregator's side's waits until its watch
has declared the exchange again, then goes (declared_again), so the aggregator goes on.
"""

from __future__ import annotations

import time
from typing import Any

import pika.exceptions as pe
import structlog

from fedmq.broker.transport import topology as t
from fedmq.broker.transport.errors import REFUSALS, BrokerError, refusal
from fedmq.broker.transport.queues import job_queues
from fedmq.broker.transport.rabbit_io import IoThread

log = structlog.get_logger(__name__)


_Job = tuple[str, tuple[str, ...], bool, int, tuple[int, ...]]  # (job, agents, inbox, model bytes, edges)


class JobTopology:
    """The declared jobs of one connection and the watch on their exchanges (see module docstring).

    Its methods run on the I/O thread (``missing`` also in the thread of a presence publish).
    ``report_missing`` False leaves reporting a missing exchange to another connection (a presence lane's
    broker)."""

    def __init__(
        self, io: IoThread, user: str, exchange_check_s: float, *, report_missing: bool = True
    ) -> None:
        self._io, self.user = io, user
        self.exchange_check_s = exchange_check_s
        self.report_missing = report_missing
        self.gone: dict[str, float] = {}  # exchange -> when it was first seen missing
        self._next_check = time.monotonic() + exchange_check_s
        self._watch_ch: Any = None
        self._jobs: list[_Job] = []

    def declare(
        self, job: str, agents: tuple[str, ...], inbox: bool, model_bytes: int, edges: tuple[int, ...] = ()
    ) -> None:
        """Declare the job now and keep it, to declare it again after a reconnect."""
        self._declare_now(job, agents, inbox, model_bytes, edges)
        if (job, agents, inbox, model_bytes, edges) not in self._jobs:
            self._jobs.append((job, agents, inbox, model_bytes, edges))

    def restore(self) -> None:
        """After a reconnect: every declared job again."""
        for job, agents, inbox, size, edges in list(self._jobs):
            self._declare_now(job, agents, inbox, size, edges)

    def _declare_now(
        self,
        job: str,
        agents: tuple[str, ...],
        inbox: bool,
        model_bytes: int = 0,
        edges: tuple[int, ...] = (),
    ) -> None:
        conn = self._io.conn
        assert conn is not None
        specs = job_queues(job, agents, inbox=inbox, model_bytes=model_bytes, edges=edges)
        ex = t.exchange(job)
        ch = conn.channel()
        if not inbox:
            # agents lack configure permission on the exchange: check it exists, create it only if allowed
            try:
                ch.exchange_declare(ex, exchange_type="topic", passive=True)
            except pe.ChannelClosedByBroker:
                ch = conn.channel()
                try:
                    ch.exchange_declare(ex, exchange_type="topic", durable=True)
                except pe.ChannelClosedByBroker as exc:
                    raise BrokerError(
                        f"exchange {ex!r} does not exist and user {self.user!r} may not create "
                        f"it ({exc.reply_code}): start the aggregator first"
                    ) from None
        try:
            if inbox:
                ch.exchange_declare(ex, exchange_type="topic", durable=True)
            for s in specs:
                ch.queue_declare(s.name, durable=True, arguments=s.arguments or None)
                for b in s.bindings:
                    ch.queue_bind(s.name, ex, routing_key=b)
        except pe.ChannelClosedByBroker as exc:
            what = f"declaring job {job!r} refused by the broker: {exc.reply_code} {exc.reply_text}"
            if exc.reply_code == 403:
                raise refusal(self.user, f"declare {job}", what) from None
            raise BrokerError(what) from None
        REFUSALS.clear(self.user, f"declare {job}")
        self.gone.pop(ex, None)
        if ch.is_open:
            ch.close()

    # ---- the jobs' exchanges ------------------------------------------------------------------------
    def _vhost(self) -> str:
        return str(self._io.reconnection.node.virtual_host)

    def missing(self, ex: str) -> BrokerError:
        """A publish found ``ex`` gone: one error line (once until it is back), and the watch checks it every
        second from now on."""
        if ex not in self.gone:
            self.gone[ex] = time.monotonic()
            if self.report_missing:
                log.error(t.missing_exchange(ex, self._vhost()), user=self.user)
        self._next_check = min(self._next_check, time.monotonic() + 1.0)
        return BrokerError(t.missing_exchange(ex, self._vhost()))

    def declared_again(self, ex: str) -> bool:
        """In a publishing thread, after a publish found ``ex`` missing: wait until the watch has declared it
        again. False at once on a side that does not declare it (an agent's), or when it is still missing
        after the watch's delay (3 checks, and some)."""
        if not any(inbox and t.exchange(job) == ex for job, _, inbox, _, _ in list(self._jobs)):
            return False
        deadline = time.monotonic() + 4 * self.exchange_check_s + 5
        while ex in self.gone and time.monotonic() < deadline:
            time.sleep(0.1)
        return ex not in self.gone

    def _exchange_exists(self, ex: str) -> bool:
        """A passive declare on a channel kept for it (one round trip); True when unsure."""
        conn = self._io.conn
        assert conn is not None
        if self._watch_ch is None or not self._watch_ch.is_open:
            self._watch_ch = conn.channel()
        try:
            self._watch_ch.exchange_declare(ex, exchange_type="topic", passive=True)
            return True
        except pe.ChannelClosedByBroker as exc:
            self._watch_ch = None
            return exc.reply_code != 404

    def tick(self) -> None:
        """Every ``exchange_check_s`` (every second while one is missing): check the declared jobs'
        exchanges; report a missing one, and declare or bind again (see module docstring)."""
        now = time.monotonic()
        if now < self._next_check or self._io.conn is None or not self._jobs:
            return
        self._next_check = now + (min(1.0, self.exchange_check_s) if self.gone else self.exchange_check_s)
        by_exchange: dict[str, list[_Job]] = {}
        for entry in self._jobs:
            by_exchange.setdefault(t.exchange(entry[0]), []).append(entry)
        for ex, entries in by_exchange.items():
            if self._exchange_exists(ex):
                if ex in self.gone:
                    self._declare_again(ex, entries, "the job's exchange is back: its queues are bound again")
                continue
            if ex not in self.gone:
                self.gone[ex] = now
                log.error(t.missing_exchange(ex, self._vhost()), user=self.user)
            elif any(e[2] for e in entries) and now - self.gone[ex] >= 3 * self.exchange_check_s:
                self._declare_again(ex, entries, "declared the job's missing exchange again")

    def _declare_again(self, ex: str, entries: list[_Job], what: str) -> None:
        try:
            for job, agents, inbox, size, edges in entries:
                self._declare_now(job, agents, inbox, size, edges)
        except BrokerError as exc:
            log.warning("declaring the job again failed; retrying", exchange=ex, error=str(exc))
            return
        self.gone.pop(ex, None)
        log.warning(what, exchange=ex, vhost=self._vhost())
