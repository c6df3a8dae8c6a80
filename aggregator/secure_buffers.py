"""Asynchronous jobs under secure aggregation (`secagg = true` with the `async` strategy,
docs/guide/secure-aggregation.md): each version is one secure buffer, and the sum of its members' changes is
all the aggregator learns of them.

A version is announced to every agent online, as in aggregator.async_rounds; an agent trains from the newest
version it has read, reports, and then checks in: it advertises its public keys (secagg-keys), tagged with
the version it trained from. The buffer's cohort is formed from the check-ins in the order they came, up to
K (the strategy's ``buffer_size``; at least 3, fedmq.secagg.graph.MIN_COHORT, and the job's
``min_clients``), once K are in, once nobody online can still check in from the announced version (as an
asynchronous version folds early), or at the report plus the update deadline. Check-ins beyond K wait for
the next buffer, as updates beyond K wait for the next version; a client that checks in again (a host's
client trains from the next version while its check-in waits: client_agent.host) replaces its older
check-in, whose round is told. One from a version more than ``max_staleness`` back, from a version the
client's change was already folded from, from an agent gone offline, or with keys that cannot be agreed
with, is dropped with its reason and its client told (a grant naming the check-in in ``refused``), to
train from the newest version.

The cohort then runs the synchronous round's steps (aggregator.secure_round: shares, masked inputs,
unmasking), in which each member weighs its clipped change by its staleness weight s(τ), τ = the buffer's
version − its own, as well as by n_k (client_agent.secure_upload), so that the unmasked sum is
Σ s(τ_k) n_k Δ_k and its weight Σ n_k: BufferedAsync folds it (``fold_partial``, which applies η_g) into
the next version, as it folds K updates in the clear. A buffer that cannot complete once its cohort went out
is skipped in one line, the version unchanged, and its members released (a grant naming them in
``released``); the next buffer is announced with the same version. One that cannot form keeps the check-ins
waiting.

Crash safety. A check-in and its client's report (n_k, loss) are held unacked until the check-in is taken
into a cohort or dropped, so a restarted aggregator gets them again; the spool names a cohort's members before
their check-ins are acked and its message goes out. As in a secure round nothing of one client's input is
written, and a buffer that a restart finds open is closed as skipped, its members told (their check-ins
refused, and the buffer released).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection
from typing import Any

import structlog

from fedmq.aggregator.async_rounds import Owed
from fedmq.aggregator.inbox import Received
from fedmq.aggregator.rounds import RoundContext
from fedmq.aggregator.secure_round import SecureRound, checked_keys
from fedmq.broker.wire import messages
from fedmq.broker.wire.envelope import Kind
from fedmq.errors import SecAggError
from fedmq.secagg import graph
from fedmq.secagg.keys import PublicKeys

log = structlog.get_logger(__name__)


class CheckIns:
    """What the buffers of one job share: the check-ins waiting for a cohort (client -> its secagg-keys
    message, oldest first) and each client's reports (its n_k and loss, by the version it trained from), both
    held unacked until the check-in is settled, so that a restarted aggregator gets them again."""

    def __init__(self) -> None:
        self.waiting: dict[str, Received] = {}
        self.reports: dict[str, dict[int, Received]] = {}
        self.interrupted: set[str] = set()  # check-ins of a buffer a restart closed: never taken again
        # check-ins a newer one of their client replaced: held unacked until their client is told
        # (SecureBuffer._tell_superseded), so that a crash in between gives them again
        self.superseded: list[tuple[str, Received]] = []

    def take(self, ctx: RoundContext, msg: Received) -> bool:
        """A check-in (kept for a cohort; one a client at a time, the newer kept) or a report (kept beside
        it). True when ``msg`` was one."""
        env = msg.env
        if env.kind not in (Kind.SECAGG_KEYS, Kind.REPORT):
            return False
        if env.msg_id in self.interrupted:  # given again after the restart; its client was told
            ctx.inbox.drop(msg, "interrupted")
            return True
        if env.kind is Kind.REPORT:
            reports = self.reports.setdefault(env.client, {})
            older = reports.pop(env.model_version, None)
            reports[env.model_version] = msg
            if older is not None:
                ctx.inbox.drop(older, "superseded")
            return True
        older = self.waiting.pop(env.client, None)
        self.waiting[env.client] = msg
        if older is not None:  # trained again meanwhile (or lost its keys with a reconnect)
            self.superseded.append((env.client, older))
            self._settle_reports(ctx, env.client, env.model_version - 1)  # the replaced one's: unused
        return True

    def samples(self, client: str, version: int) -> int | None:
        report = self.reports.get(client, {}).get(version)
        return None if report is None else int(report.env.payload["n_samples"])

    def loss(self, client: str, version: int) -> float | None:
        report = self.reports.get(client, {}).get(version)
        return None if report is None else float(report.env.payload["loss"])

    def interrupt(self, ctx: RoundContext, check_ins: Collection[str]) -> None:
        """The check-ins (message ids) of a buffer a restart closed: their clients are told, and the
        messages, if the broker gives them again, are dropped."""
        self.interrupted.update(check_ins)
        for client, msg in list(self.waiting.items()):
            if msg.env.msg_id in self.interrupted:
                self.settle(ctx, client, "interrupted")

    def settle(self, ctx: RoundContext, client: str, dropped: str | None = None) -> None:
        """``client``'s check-in is taken (acked), or ``dropped`` with that reason; its reports go too, those
        from its version and older (one from a newer version waits for its own check-in; all of them when the
        client has no check-in waiting)."""
        msg = self.waiting.pop(client, None)
        if msg is not None and dropped is None:
            ctx.inbox.ack(msg)
        elif msg is not None:
            ctx.inbox.drop(msg, dropped)
        upto = msg.env.model_version if msg is not None else max(self.reports.get(client, {}), default=0)
        self._settle_reports(ctx, client, upto)

    def _settle_reports(self, ctx: RoundContext, client: str, upto: int) -> None:
        """``client``'s reports from version ``upto`` and older are acked."""
        reports = self.reports.get(client, {})
        for version in [v for v in reports if v <= upto]:
            ctx.inbox.ack(reports.pop(version))
        if not reports:
            self.reports.pop(client, None)


class SecureBuffers:
    """Runs the job's asynchronous versions under secure aggregation until ``cfg.rounds`` are published (or
    ``ctx.stop`` is set)."""

    def __init__(self, ctx: RoundContext) -> None:
        self.ctx = ctx
        self.checkins = CheckIns()

    def run(self) -> None:
        ctx, cfg = self.ctx, self.ctx.cfg
        # as an asynchronous job's first version: wait for a buffer's worth of agents (check-ins a stopped
        # aggregator left unacked come again meanwhile)
        ctx.wait_for_agents(min(ctx.buffer_size, cfg.clients), cfg.join_timeout_s, self._while_waiting)
        while ctx.version < cfg.rounds and not ctx.stop.is_set() and ctx.within_budget():
            SecureBuffer(ctx, self.checkins).run()
        if not ctx.stop.is_set():  # the job's end (its rounds, or its privacy budget): the agents leave
            for client in list(self.checkins.waiting):
                self.checkins.settle(ctx, client, "job-finished")
            for client in list(self.checkins.reports):
                self.checkins.settle(ctx, client)
            for _, msg in self.checkins.superseded:
                ctx.inbox.drop(msg, "job-finished")
            self.checkins.superseded.clear()

    def _while_waiting(self, msg: Received) -> None:
        while_waiting(self.ctx, self.checkins, msg)


def while_waiting(ctx: RoundContext, checkins: CheckIns, msg: Received) -> None:
    """The engine's wait for agents hands every message here: presence noted, check-ins and reports kept,
    anything else dropped."""
    if msg.env.kind is Kind.PRESENCE:
        ctx.note_presence(msg)
    elif not checkins.take(ctx, msg):
        ctx.inbox.drop(msg, "unexpected")


class SecureBuffer(SecureRound):
    """One version of an asynchronous job under secure aggregation (module docstring)."""

    def __init__(self, ctx: RoundContext, checkins: CheckIns) -> None:
        super().__init__(ctx)
        self.checkins = checkins
        self.members: list[str] = []
        self.bases: dict[str, int] = {}  # member -> the version it trained from
        self.sources: dict[str, Received] = {}  # member -> the check-in its keys came from
        self.check_ins: dict[str, str] = {}  # member -> its check-in's message id (spooled)

    def _select(self) -> None:
        """Every agent online hears of the version (aggregator.async_rounds)."""
        ctx, cfg, stats = self.ctx, self.cfg, self.stats
        ctx.phase = "waiting-for-agents"
        # the beats that queued while the last version closed are counted first (AsyncRounds.run says why)
        ctx.wait_for_agents(1, cfg.presence_window_s, self._while_waiting)
        stats.online = ctx.online()
        stats.selected = list(stats.online)
        ctx.spool.save_online(stats.round, stats.online)
        self._save()
        if stats.selected:
            ctx.announce(stats)

    def _gather_keys(self, report_by: float) -> dict[str, PublicKeys]:
        """The cohort's check-ins, oldest first (module docstring)."""
        ctx, cfg, stats = self.ctx, self.cfg, self.stats
        ctx.phase = "secure-check-in"
        needed = max(graph.MIN_COHORT, cfg.min_clients)
        target = max(ctx.buffer_size, needed)
        deadline = time.time() + cfg.report_deadline_s + cfg.update_deadline_s
        # a client whose check-in waits may not train from this version (a one-client agent waits for its
        # cohort; a host's client parked while one was newer): a buffer short of K does not wait for it
        owed = Owed(ctx.version, [c for c in stats.online if c not in self.checkins.waiting])
        roster: dict[str, PublicKeys] = {}
        while not ctx.stop.is_set():
            self._admit(roster, target, owed)
            if len(roster) >= target or time.time() >= deadline:
                break
            if len(roster) >= needed and owed.nobody(ctx.online()):
                log.info("nobody else can check in: the buffer forms", round=stats.round, members=len(roster))
                break
            msg = ctx.inbox.next(min(0.5, max(deadline - time.time(), 0.0)))
            if msg is None:
                continue
            owed.note(msg.env)
            if msg.env.kind is Kind.SECAGG_KEYS:  # from an older version: it may wait now, not train
                owed.waiting.discard(msg.env.client)
            if not self._screen(msg):
                ctx.inbox.drop(msg, "not-in-step-check-in")
        return roster

    def _admit(self, roster: dict[str, PublicKeys], target: int, owed: Owed) -> None:
        """Check-ins into ``roster``, oldest first, until it holds ``target`` (a client's newer check-in
        replacing its older one there too); one that cannot be taken is dropped or refused with its reason,
        its client told first (one that checked in from an older version then trains from this one: ``owed``
        waits for it again)."""
        ctx, checkins = self.ctx, self.checkins
        online = set(ctx.online())
        self._tell_superseded()
        # the roster's own clients first (one whose newer check-in is refused frees its place), then the
        # others in the order they came
        for client, msg in sorted(checkins.waiting.items(), key=lambda item: item[0] not in roster):
            if len(roster) >= target and client not in roster:
                continue
            if self.sources.get(client) is msg:
                continue
            version = msg.env.model_version
            why = None
            if client not in online:
                why = "offline"
            elif version > ctx.version:
                why = "future-version"
            elif ctx.version - version > ctx.max_staleness:
                why = "too-stale"
            elif version <= ctx.folded_from.get(client, messages.NO_VERSION):
                why = "duplicate"  # one change a client and version, as in the clear (async_rounds)
            else:
                try:
                    roster[client] = checked_keys(msg)
                    self.bases[client], self.sources[client] = version, msg
                    continue
                except SecAggError as exc:  # counted, as a step's refusal (SecureRound._step)
                    ctx.inbox.count_rejection(exc.reason, f"{client}: {exc}")
                    why = "refused"
            roster.pop(client, None)  # (its older check-in, now superseded, may be there)
            self.sources.pop(client, None)
            # told before its check-in is settled: a crash in between gives the check-in again, not a client
            # left waiting
            self._refuse(client, msg)
            checkins.settle(ctx, client, why)
            if client in online and version < ctx.version:  # it holds this version's announcement
                owed.waiting.add(client)

    def _formed(self, members: list[str]) -> None:
        """The spool names the members (a restart tells them the buffer is gone), then their check-ins and
        reports are taken (acked)."""
        stats, checkins = self.stats, self.checkins
        bases = self.bases
        self.samples = {c: n for c in members if (n := checkins.samples(c, bases[c])) is not None}
        stats.reported = {c: loss for c in members if (loss := checkins.loss(c, bases[c])) is not None}
        self.members = members
        taus = Counter(self.ctx.version - bases[c] for c in members)
        log.info("secure buffer", round=stats.round, staleness={str(t): n for t, n in sorted(taus.items())})
        self.check_ins = {c: self.sources[c].env.msg_id for c in members}
        stats.selected = sorted(set(stats.selected) | set(members))
        self._save()
        for client in members:
            checkins.settle(self.ctx, client)

    def _cohort_audience(self, members: list[str]) -> list[str]:
        """Only the members: a client whose check-in waits for a later buffer keeps waiting."""
        return members

    def _trained_from(self, client: str) -> int:
        return self.bases[client]

    def _fold(self, strategy: Any, mean: Any, weight: float, survivors: list[str]) -> None:
        super()._fold(strategy, mean, weight, survivors)
        for client in survivors:
            self.stats.trained_from[client] = self.bases[client]

    def _release(self, restart: bool = False) -> None:
        """The members still waiting for a step of this buffer stop waiting (the others keep theirs). After a
        restart a member may still wait for the cohort, so the grant also refuses its check-in."""
        ids = self.check_ins

        def release(served: list[str]) -> dict[str, Any]:
            return {**released(served), **(refused([ids[c] for c in served if c in ids]) if restart else {})}

        self._send(Kind.GRANT, self.members, release)

    def _restored(self, spooled: dict[str, Any]) -> None:
        self.members = list(spooled.get("members") or [])
        self.check_ins = dict(spooled.get("check_ins") or {})
        self.checkins.interrupt(self.ctx, self.check_ins.values())

    def _state(self) -> dict:
        return {**super()._state(), "members": self.members, "check_ins": self.check_ins}

    def _screen(self, msg: Received) -> bool:
        """Check-ins and reports come between the steps too; the rest as in a secure round."""
        if self.checkins.take(self.ctx, msg):
            self._tell_superseded()
            return True
        return super()._screen(msg)

    def _while_waiting(self, msg: Received) -> None:
        while_waiting(self.ctx, self.checkins, msg)
        self._tell_superseded()

    def _tell_superseded(self) -> None:
        """The round of each check-in a newer one replaced stops waiting (a grant that refuses it), and then
        the check-in is dropped: a crash in between gives it again, and the newer one replaces it again."""
        checkins = self.checkins
        while checkins.superseded:
            client, msg = checkins.superseded.pop(0)
            self._refuse(client, msg)
            self.ctx.inbox.drop(msg, "superseded")

    def _refuse(self, client: str, check_in: Received) -> None:
        """A grant that refuses ``client``'s ``check_in``: the round waiting with it stops waiting."""
        self._send(Kind.GRANT, [client], lambda _: refused([check_in.env.msg_id]))


def released(served: list[str]) -> dict[str, Any]:
    """An empty grant that ends the buffer for ``served`` only (the members)."""
    return {"granted": [], "released": served}


def refused(check_ins: list[str]) -> dict[str, Any]:
    """An empty grant that refuses the check-ins of these message ids: only a client still waiting with one
    of them stops waiting (a member's end of a buffer, or a refusal of an older check-in, cannot be taken
    for it: either may come after the client has checked in again)."""
    return {"granted": [], "refused": check_ins}
