"""Asynchronous mode (FedBuff-style): fold every K arrivals with a staleness weight,
publish a new version each time.

Crash safety as in synchronous rounds: an update is acked once spooled; a restart replays the open round's
spool in arrival order against the versions the updates trained from (kept in the spool,
aggregator.spool.RoundSpool.save_base), and drops redeliveries of updates already folded (by message id). The
folding order of live updates is their arrival order: async runs are not bit-reproducible.

Folding before K arrivals. Every agent online when a version is announced owes one update trained from it
(an async agent trains on every version it reads). A version is folded with fewer than K updates (the
strategy's ``buffer_size``), without waiting for the deadlines, once nobody else can arrive: at least one
update is in, and every agent that owed one has delivered its update from this version, said it went offline
(an availability model's absence: it has read this announcement and will not train on it), or fell silent
past the presence horizon (three heartbeats). An agent that comes online after the announcement is not waited
for: a new agent's queue did not exist when the version was announced; one that does hold the announcement is
folded into a later version, with its staleness. So a population with fewer agents online than K publishes a
version as soon as those online have trained, instead of once per report plus update deadline. Who is online
is read afresh before each announcement (the presence that queued while the last version was evaluated and
checkpointed, as a synchronous round's selection does), and the first version waits, up to the join time-out,
for a buffer's worth of agents.

Every update the broker confirmed to an agent is folded or dropped with a reason (logged with its message id):
updates that arrive before a restarted aggregator's first announcement are kept, unacked, for its first
version (not dropped); redeliveries of folded updates are ``duplicate``, and so is a second update of a client
from a version one of its updates was already folded from (one per client and version, checkpointed: an agent
that lost a confirm with its connection trains again from the same version); updates from versions no longer
kept ``too-stale``; once the last version is published, the updates already queued are ``job-finished``, and
with a durable spool (services, ``simulate`` over RabbitMQ) the aggregator first waits, at most the report
plus the update deadline, for the updates the agents online at the last announcement still owe, and drops them
as ``job-finished`` too, so that nothing confirmed is left in the inbox when the job ends. Agents' reports
(which precede each update) carry nothing the update does not: they are acked without a count. An update
the guard could not judge on arrival (no reference yet: aggregator.guards) is folded, spooled and acked,
and judged with the buffer's other such updates at its close; one found out of bounds then is left out
(logged with its message id) and the buffer folded again from its spool.
"""

from __future__ import annotations

import time

import structlog

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.inbox import Received
from fedmq.aggregator.rounds import Arrival, RoundContext, RoundStats
from fedmq.aggregator.strategies.base import State, Strategy
from fedmq.broker.wire import messages
from fedmq.broker.wire.envelope import Envelope, Kind
from fedmq.errors import BadParameter

log = structlog.get_logger(__name__)


def async_window(cfg: JobConfig, strategy: Strategy) -> tuple[int, int]:
    """The job's K and staleness bound: its asynchronous strategy's ``buffer_size`` and ``max_staleness``
    (BufferedAsync's parameters); (1, 0) for a synchronous one, which has neither."""
    if strategy.plan.mode != "async":
        return 1, 0
    sizes = (getattr(strategy, "buffer_size", None), getattr(strategy, "max_staleness", None))
    if not all(isinstance(n, int) for n in sizes):
        raise BadParameter(
            f"strategy {cfg.strategy!r}: an asynchronous strategy needs int attributes buffer_size and "
            "max_staleness (as fedmq.BufferedAsync's)"
        )
    return sizes  # type: ignore[return-value]


class Owed:
    """Who may still send an update (under secure aggregation: a check-in) trained from the version announced
    last (see the module docstring)."""

    def __init__(self, version: int, online: list[str]) -> None:
        self.version = version
        self.waiting = set(online)

    def note(self, env: Envelope) -> None:
        if env.kind in (Kind.UPDATE, Kind.SECAGG_KEYS) and env.model_version == self.version:
            self.waiting.discard(env.client)
        elif env.kind is Kind.PRESENCE and env.payload["state"] != "online":
            self.waiting.discard(env.client)

    def nobody(self, online: list[str]) -> bool:
        """True when no agent online now still owes an update from this version."""
        return not self.waiting.intersection(online)


class AsyncRounds:
    """Runs the job's asynchronous versions until ``cfg.rounds`` are published (or ``ctx.stop`` is set)."""

    def __init__(self, ctx: RoundContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.history: dict[int, State] = {}  # the versions updates may still train from (max_staleness back)
        self.early: list[Received] = []  # updates that arrived before the first announcement (unacked)
        self.folded_ids: set[str] = set()  # message ids of every update folded before the open version
        self.folded_n: dict[str, int] = {}  # the open version's folded updates: message id -> n as folded

    def run(self) -> None:
        ctx, cfg = self.ctx, self.cfg
        # the first version, as a synchronous job's first round, waits for agents to join: a buffer's worth
        # (or the whole job, when smaller), so that it is not announced to the first one alone and closed on
        # its update
        ctx.wait_for_agents(min(ctx.buffer_size, cfg.clients), cfg.join_timeout_s, self._while_waiting)
        self.history = ctx.spool.load_bases(ctx.version - ctx.max_staleness)
        _, spooled = ctx.spool.load(ctx.round)
        if spooled:
            log.info("resuming open round", round=ctx.round, spooled_updates=len(spooled))
        owed: Owed | None = None
        while ctx.version < cfg.rounds and not ctx.stop.is_set() and ctx.within_budget():
            # the beats that queued while the last version closed (evaluation, checkpoint) are counted first:
            # unread, they would leave live agents looking offline, and the version would then close on its
            # first update (nobody else can arrive)
            ctx.wait_for_agents(1, cfg.presence_window_s, self._while_waiting)
            stats = RoundStats(ctx.round, online=ctx.online())
            stats.selected = stats.online
            self._keep_bases()
            ctx.announce(stats)
            owed = Owed(ctx.version, stats.online)
            strategy = ctx.begin_strategy(stats, cfg.strategy)
            self.folded_ids = ctx.folded_ids()
            self.folded_n = {}
            for key in _arrival_order(spooled):  # replay
                body = ctx.spool.read_update(ctx.round, key)
                if body is None:
                    continue
                env = messages.decode(body, limits=ctx.inbox.limits)
                owed.note(env)
                self._fold(stats, strategy, env, body)
            spooled = []
            early, self.early = self.early, []
            for msg in early:
                owed.note(msg.env)
                self._take(stats, strategy, msg)
            self._collect(stats, strategy, owed)
            if stats.received:
                strategy = self._judge_held(stats, strategy)
            ctx.close_round(stats, strategy if stats.received else None)
        if ctx.version >= cfg.rounds and not ctx.stop.is_set():
            self._wind_down(owed)

    def _while_waiting(self, msg: Received) -> None:
        """The engine's wait for the first agent hands every message here: an update that arrives first --
        confirmed to its agent while the aggregator was down -- is kept for the first version."""
        if msg.env.kind is Kind.UPDATE:
            self.early.append(msg)
        else:
            self._other(msg)

    def _other(self, msg: Received) -> None:
        """Not an update: presence is noted, a report acked (its update carries its loss)."""
        kind = msg.env.kind
        if kind is Kind.PRESENCE:
            self.ctx.note_presence(msg)
        elif kind is Kind.REPORT:
            self.ctx.inbox.ack(msg)
        else:
            self.ctx.inbox.drop(msg, "unexpected")

    def _keep_bases(self) -> None:
        """Keep the current version (in memory and in the spool) and drop those too stale to train from."""
        ctx = self.ctx
        if ctx.version not in self.history:
            self.history[ctx.version] = ctx.global_state
            ctx.spool.save_base(ctx.version, ctx.global_state)
        for old in [v for v in self.history if v < ctx.version - ctx.max_staleness]:
            del self.history[old]
        ctx.spool.drop_bases_before(ctx.version - ctx.max_staleness)

    def _collect(self, stats: RoundStats, strategy: Strategy, owed: Owed) -> None:
        ctx, cfg = self.ctx, self.cfg
        deadline = time.time() + cfg.report_deadline_s + cfg.update_deadline_s
        while len(stats.received) < ctx.buffer_size and time.time() < deadline and not ctx.stop.is_set():
            if stats.received and owed.nobody(ctx.online()):
                log.info(
                    "nobody else can arrive: folding what came",
                    round=stats.round,
                    version=ctx.version,
                    received=len(stats.received),
                    buffer_size=ctx.buffer_size,
                )
                return
            msg = ctx.inbox.next(min(0.5, deadline - time.time()))
            if msg is None:
                continue
            owed.note(msg.env)
            if msg.env.kind is Kind.UPDATE:
                self._take(stats, strategy, msg)
            else:
                self._other(msg)

    def _take(self, stats: RoundStats, strategy: Strategy, msg: Received) -> None:
        """A live update: fold it, or drop it with the reason it cannot be."""
        ctx, env = self.ctx, msg.env
        if env.msg_id in self.folded_ids or env.msg_id in stats.update_ids.values():
            ctx.inbox.drop(msg, "duplicate")  # redelivered after a crash: already folded
        elif env.model_version <= max(
            ctx.folded_from.get(env.client, messages.NO_VERSION),
            stats.trained_from.get(env.client, messages.NO_VERSION),
        ):
            # a second update from a version this client's update was folded from (retrained after a lost
            # confirm, or sent twice): one per client and version, as a synchronous round takes one per client
            ctx.inbox.drop(msg, "duplicate")
        elif ctx.version - env.model_version > ctx.max_staleness or env.model_version not in self.history:
            ctx.inbox.drop(msg, "too-stale")
        elif self.cfg.dp != "none" and env.client in stats.trained_from:
            # under DP a client contributes at most once a version (the clip bound is per release): its
            # newer update waits, unacked, for the next version
            self.early.append(msg)
        else:
            self._fold(stats, strategy, env, msg.delivery.body, msg)

    def _judge_held(self, stats: RoundStats, strategy: Strategy) -> Strategy:
        """The buffer's updates that had no reference, judged together (RoundGuard.judge_held); when one is
        out of bounds the buffer is folded again from its spool, in arrival order, without the dropped ones
        and with the capped weights (an honest buffer is folded once)."""
        ctx = self.ctx
        verdict = ctx.guard.judge_held(ctx.global_state)
        if not verdict:
            return strategy
        for uid, why in verdict.dropped.items():
            log.warning("update out of bounds: left out of the version", msg_id=uid, reason=why)
        log.warning(
            "updates with no reference out of bounds: the buffer is folded again without them",
            round=stats.round,
            dropped=ctx.guard.screened.dropped,
            capped=ctx.guard.screened.capped,
        )
        stats.update_ids = {c: uid for c, uid in stats.update_ids.items() if uid not in verdict.dropped}
        screened = ctx.guard.screened
        strategy = ctx.begin_strategy(stats, self.cfg.strategy)  # begins the guard afresh: keep its verdict
        ctx.guard.screened = screened
        _, spooled = ctx.spool.load(stats.round)
        for key in _arrival_order(spooled):
            body = ctx.spool.read_update(stats.round, key)
            if body is None:
                continue
            env = messages.decode(body, limits=ctx.inbox.limits)
            if env.msg_id in verdict.dropped:
                continue
            n = verdict.capped.get(env.msg_id, self.folded_n[env.msg_id])  # a cap is below the n folded
            base, staleness = self.history[env.model_version], ctx.version - env.model_version
            strategy.fold(ctx.decode_update(env, base, staleness, n_samples=n))
        return strategy

    def _wind_down(self, owed: Owed | None) -> None:
        """The last version is published: drop what is queued, and (durable spool) what is still owed, as
        ``job-finished`` (the module docstring says why)."""
        ctx, cfg = self.ctx, self.cfg
        wait = owed is not None and ctx.spool.durable
        deadline = time.time() + (cfg.report_deadline_s + cfg.update_deadline_s if wait else 0.0)
        backlog = ctx.inbox.mark()
        while not ctx.stop.is_set():
            pending = wait and owed is not None and not owed.nobody(ctx.online())
            if ctx.inbox.drained(backlog) and (not pending or time.time() >= deadline):
                break
            msg = ctx.inbox.next(min(0.5, max(deadline - time.time(), 0.0)) if pending else 0.0)
            if msg is None:
                if not pending:
                    break
                continue
            if owed is not None:
                owed.note(msg.env)
            if msg.env.kind is Kind.UPDATE:
                ctx.inbox.drop(msg, "job-finished")
            else:
                self._other(msg)
        if owed is not None and wait and not owed.nobody(ctx.online()):
            log.warning(
                "job finished with updates still owed", clients=sorted(owed.waiting & set(ctx.online()))
            )

    def _fold(
        self, stats: RoundStats, strategy: Strategy, env: Envelope, body: bytes, msg: Received | None = None
    ) -> None:
        """Fold one update (live ``msg``, or replayed from the spool when None), spool it, then ack it."""
        ctx = self.ctx
        base = self.history.get(env.model_version)
        if base is None:
            if msg is not None:
                ctx.inbox.drop(msg, "too-stale")
            return
        arrival = len(stats.received)
        update = ctx.fold(
            stats,
            strategy,
            Arrival(env, len(body), base, staleness=ctx.version - env.model_version, received=msg),
            screen=True,
        )
        if update is None:
            return
        self.folded_n[env.msg_id] = int(update.n_samples)
        if msg is not None:
            ctx.spool.save_update(stats.round, f"{env.client}-{arrival}", body)
        stats.update_ids[f"{env.client}#{arrival + 1}"] = env.msg_id
        newest = stats.trained_from.get(env.client, messages.NO_VERSION)
        stats.trained_from[env.client] = max(env.model_version, newest)
        stats.reported[env.client] = float(env.payload["loss"])
        if msg is not None:
            ctx.inbox.ack(msg)


def _arrival_order(spooled: list[str]) -> list[str]:
    """The open version's spool keys (``client-arrival``) in arrival order."""
    return sorted(spooled, key=lambda k: int(k.rsplit("-", 1)[1]))
