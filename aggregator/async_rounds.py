"""Asynchronous mode (FedBuff-style): fold every K arrivals with a staleness weight,
publish a new version each time.

Crash safety as in synchronous rounds: an update is acked once spooled; a restart replays the open round's
spool in arrival order against the versions the updates trained from (kept in the spool,
aggregator.spool.RoundSpool.save_base), and drops redeliveries of updates already folded (by message id). The
folding order of live updates is their arrival order: async runs are not bit-reproducible.
"""

from __future__ import annotations

import time

import structlog

from fedmq.aggregator.inbox import Received
from fedmq.aggregator.rounds import RoundContext, RoundStats
from fedmq.aggregator.strategies.base import State, Strategy
from fedmq.broker.wire import messages
from fedmq.broker.wire.envelope import Envelope, Kind

log = structlog.get_logger(__name__)


class AsyncRounds:
    """Runs the job's asynchronous versions until ``cfg.rounds`` are published (or ``ctx.stop`` is set)."""

    def __init__(self, ctx: RoundContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.history: dict[int, State] = {}  # the versions updates may still train from (max_staleness back)

    def run(self) -> None:
        ctx, cfg = self.ctx, self.cfg
        ctx.wait_for_agents(1, cfg.join_timeout_s)
        self.history = ctx.spool.load_bases(ctx.version - cfg.max_staleness)
        _, spooled = ctx.spool.load(ctx.round)
        if spooled:
            log.info("resuming open round", round=ctx.round, spooled_updates=len(spooled))
        while ctx.version < cfg.rounds and not ctx.stop.is_set():
            stats = RoundStats(ctx.round, online=ctx.online())
            stats.selected = stats.online
            self._keep_bases()
            ctx.announce(stats)
            strategy = ctx.begin_strategy(stats, cfg.strategy)
            for key in sorted(spooled, key=lambda k: int(k.rsplit("-", 1)[1])):  # replay, in arrival order
                self._fold(
                    stats, strategy, messages.decode(spooled[key], limits=ctx.inbox.limits), spooled[key]
                )
            spooled = {}
            self._collect(stats, strategy)
            ctx.close_round(stats, strategy if stats.received else None)

    def _keep_bases(self) -> None:
        """Keep the current version (in memory and in the spool) and drop those too stale to train from."""
        ctx, cfg = self.ctx, self.cfg
        if ctx.version not in self.history:
            self.history[ctx.version] = ctx.global_state
            ctx.spool.save_base(ctx.version, ctx.global_state)
        for old in [v for v in self.history if v < ctx.version - cfg.max_staleness]:
            del self.history[old]
        ctx.spool.drop_bases_before(ctx.version - cfg.max_staleness)

    def _collect(self, stats: RoundStats, strategy: Strategy) -> None:
        ctx, cfg = self.ctx, self.cfg
        folded_ids = ctx.folded_ids()
        deadline = time.time() + cfg.report_deadline_s + cfg.update_deadline_s
        while len(stats.received) < cfg.async_k and time.time() < deadline and not ctx.stop.is_set():
            msg = ctx.inbox.next(min(0.5, deadline - time.time()))
            if msg is None:
                continue
            env = msg.env
            if env.kind is Kind.PRESENCE:
                ctx.note_presence(msg)
            elif env.kind is not Kind.UPDATE:
                ctx.inbox.drop(msg, "unexpected")
            elif env.msg_id in folded_ids or env.msg_id in stats.update_ids.values():
                ctx.inbox.drop(msg, "duplicate")  # redelivered after a crash: already folded
            elif ctx.version - env.model_version > cfg.max_staleness or env.model_version not in self.history:
                ctx.inbox.drop(msg, "too-stale")
            else:
                self._fold(stats, strategy, env, msg.delivery.body, msg)

    def _fold(
        self, stats: RoundStats, strategy: Strategy, env: Envelope, body: bytes, msg: Received | None = None
    ) -> None:
        """Fold one update (live ``msg``, or replayed from the spool when None), spool it, then ack it."""
        ctx = self.ctx
        base = self.history.get(env.model_version)
        if base is None:
            if msg is not None:
                ctx.inbox.reject(
                    msg.delivery, "too-stale", f"base version {env.model_version} is no longer kept"
                )
            return
        arrival = len(stats.received)
        update = ctx.fold(
            stats,
            strategy,
            env,
            len(body),
            base=base,
            staleness=ctx.version - env.model_version,
            received=msg,
            screen=True,
        )
        if update is None:
            return
        if msg is not None:
            ctx.spool.save_update(stats.round, f"{env.client}-{arrival}", body)
        stats.update_ids[f"{env.client}#{arrival + 1}"] = env.msg_id
        stats.reported[env.client] = float(env.payload["loss"])
        if msg is not None:
            ctx.inbox.ack(msg)
