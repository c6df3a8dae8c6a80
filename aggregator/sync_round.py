"""One synchronous round: select m agents, announce, collect reports, mediate and grant (when the
job has a grant phase), fold the granted updates in a fixed order, close.

Crash safety: the round's state (selected, reports, grants, the mediator's choice) and every folded update
are spooled before the message is acked (aggregator/spool.py); a restarted aggregator resumes the open round
from the spool, re-publishing its announce (and its grant, if decided): agents ignore rounds they already
handled, and one whose announce or grant was lost with the old aggregator gets it now.
"""

from __future__ import annotations

import math
import random
import time

import structlog

from fedmq.aggregator.inbox import Received
from fedmq.aggregator.rounds import Arrival, RoundContext, RoundStats
from fedmq.aggregator.strategies.base import Strategy
from fedmq.aggregator.strategies.fedavg import FedAvg
from fedmq.broker.transport import topology
from fedmq.broker.transport.errors import Undeliverable
from fedmq.broker.wire import messages
from fedmq.broker.wire.envelope import Envelope, Kind
from fedmq.errors import CodecError
from fedmq.privacy.accountant import poisson_sample

log = structlog.get_logger(__name__)


class SyncRound:
    """Runs the engine's open round ``ctx.round`` to its close (or until ``ctx.stop`` is set)."""

    def __init__(self, ctx: RoundContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.stats = RoundStats(ctx.round)
        # arrived ahead of their turn in the fold order, unacked until folded
        self.held: dict[str, Received] = {}
        self.gone: set[str] = set()  # selected agents that announced going offline: nothing more will come

    def run(self) -> None:
        ctx, cfg, stats = self.ctx, self.cfg, self.stats
        spooled, spooled_updates = ctx.spool.load(stats.round)
        if spooled is None:
            self._select()
        else:  # resuming a round that was open when the aggregator stopped
            stats.online, stats.selected = spooled["online"], spooled["selected"]
            # who serves them (their hosts may not have beaten yet): the announce and their updates need it
            ctx.hosted.update(spooled.get("hosts") or {})
            stats.reported = spooled["reported"]
            stats.unreachable = dict(spooled.get("unreachable") or {})
            log.info(
                "resuming open round",
                round=stats.round,
                reported=len(stats.reported),
                spooled_updates=len(spooled_updates),
            )
            if (
                stats.selected
            ):  # the old announce (or grant) may have died with the old aggregator: send again, and so
                # find again who can be reached (an agent whose queue is gone is left out of the round)
                ctx.announce(stats)
                if spooled.get("granted") is not None and cfg.grant_phase:
                    self._publish_grant(spooled["granted"])
                if stats.unreachable != (spooled.get("unreachable") or {}):
                    granted = spooled.get("granted")
                    self._save(
                        None if granted is None else [c for c in granted if c in stats.selected],
                        spooled.get("strategy"),
                    )
        if not stats.selected:
            why = "nobody reachable" if stats.unreachable else "nobody online"
            ctx.close_round(
                stats, None, skipped="nobody sampled" if stats.online and cfg.dp != "none" else why
            )
            return
        strategy = self._collect(spooled, spooled_updates)
        if ctx.stop.is_set():  # interrupted (Ctrl-C, SIGTERM): the round stays open in the spool for --resume
            return
        ctx.close_round(stats, strategy)

    def _select(self) -> None:
        ctx, cfg, stats = self.ctx, self.cfg, self.stats
        ctx.phase = "waiting-for-agents"
        if stats.round == 1:  # the first round waits for the whole federation to join
            ctx.wait_for_agents(cfg.clients, cfg.join_timeout_s)
        else:  # later rounds (also right after a restart): live agents heartbeat within heartbeat_s
            ctx.wait_for_agents(cfg.selected_count(), cfg.presence_window_s)
        stats.online = ctx.online()
        rng = random.Random(f"{cfg.seed}/select/{stats.round}")
        if cfg.dp != "none" and not cfg.plan.select_all:
            # under DP, Poisson sampling with rate C, as the accountant assumes (aggregator/privacy.py): each
            # online client independently, so a client offline when sampled simply does not contribute. The
            # sample must be secret: the OS's secure source, seeded only where the noise is (`fedmq simulate`)
            secret = ctx.noise_seed is None
            sampler = random.SystemRandom() if secret else rng
            stats.selected = poisson_sample(sampler, sorted(stats.online), cfg.fraction)
        else:
            m = min(cfg.selected_count(), len(stats.online))
            stats.selected = sorted(rng.sample(stats.online, m)) if m else []
        ctx.spool.save_online(stats.round, stats.online)
        self._save(None, None)
        if stats.selected:
            ctx.announce(stats)
            if stats.unreachable:  # the spool must not list as selected an agent that was left out
                self._save(None, None)

    def _collect(self, spooled: dict | None, spooled_updates: dict[str, bytes]) -> Strategy | None:
        """Reports, mediation, grants and updates of one round;
        returns the strategy holding the folded updates."""
        ctx, cfg, stats = self.ctx, self.cfg, self.stats
        strategy: Strategy | None = None
        granted: list[str] | None = spooled.get("granted") if spooled else None
        if granted is not None or not cfg.grant_phase:
            strategy = ctx.begin_strategy(stats, (spooled or {}).get("strategy") or cfg.strategy)
            stats.granted = [
                c for c in (granted if granted is not None else stats.selected) if c in stats.selected
            ]
        for (
            client
        ) in stats.granted:  # the spool holds updates folded before a restart: refold them in fold order
            if client in spooled_updates:
                self._refold_spooled(strategy, spooled_updates[client])
        deadline = time.time() + (cfg.report_deadline_s if strategy is None else cfg.update_deadline_s)
        if strategy is not None and not cfg.grant_phase:
            deadline = time.time() + cfg.report_deadline_s + cfg.update_deadline_s
        while not ctx.stop.is_set():
            if strategy is None and (
                set(stats.reported) | self.gone >= set(stats.selected) or time.time() >= deadline
            ):
                if len(stats.reported) < cfg.min_clients:
                    return None
                strategy = self._mediate()
                deadline = time.time() + cfg.update_deadline_s
            if strategy is not None and (
                set(stats.received) | set(self.held) | self.gone >= set(stats.granted)
                or time.time() >= deadline
            ):
                self._fold_in_order(strategy, closing=True)
                return strategy
            msg = ctx.inbox.next(min(0.5, max(deadline - time.time(), 0.0)))
            if msg is not None:
                self._dispatch(msg, strategy)
        return strategy  # stopped: held updates stay unacked and come back to the next aggregator

    def _dispatch(self, msg: Received, strategy: Strategy | None) -> None:
        ctx, stats, env = self.ctx, self.stats, msg.env
        if env.kind is Kind.PRESENCE:
            # the inbox is FIFO per agent (and host): its earlier report/update came first
            self.gone.update(c for c in ctx.note_presence(msg) if c in stats.selected)
        elif env.round != stats.round:
            ctx.inbox.drop(msg, "stale-round" if env.round < stats.round else "future-round")
        elif env.client not in stats.selected:
            ctx.inbox.drop(msg, "not-selected")
        elif env.kind is Kind.REPORT:
            self._take_report(msg)
        elif env.client in stats.received or env.client in self.held:
            ctx.inbox.drop(msg, "duplicate")
        elif strategy is None or env.client not in stats.granted:
            ctx.inbox.drop(msg, "not-granted")
        else:
            stats.failed.discard(env.client)  # a new try after a rejected update
            self.held[env.client] = msg
            self._fold_in_order(strategy)

    def _fold_in_order(self, strategy: Strategy, closing: bool = False) -> None:
        """Fold held updates in the order of ``stats.granted``, never in arrival order.

        Float sums depend on the order of their terms, so folding in a fixed order is what makes the same seed
        and config give the same model bit for bit whatever the broker and whoever trains fastest (the spool
        replays in the same order after a restart). An update waits, unacked (the inbox prefetch fits the
        whole round), until every client before it has been folded, has gone offline, or the round is closing.
        """
        stats = self.stats
        for client in stats.granted:
            if client in stats.received or client in stats.failed:
                continue
            if client in self.held:
                msg = self.held.pop(client)
                self._fold(strategy, msg.env, msg.delivery.body, msg)
                if client not in stats.received:
                    # rejected: later clients need not wait for it (it may try again)
                    stats.failed.add(client)
            elif not (closing or client in self.gone):
                return

    def _refold_spooled(self, strategy: Strategy, body: bytes) -> None:
        try:
            env = messages.decode(body, limits=self.ctx.inbox.limits)
        except CodecError as exc:  # a damaged spool file: the update is lost, the round goes on without it
            log.warning("spooled update unreadable: left out", round=self.stats.round, error=str(exc))
            return
        self._fold(strategy, env, body)

    def _fold(self, strategy: Strategy, env: Envelope, body: bytes, received: Received | None = None) -> None:
        """Fold one update (live ``received``, or replayed from the spool), spool it, then ack it."""
        ctx, stats = self.ctx, self.stats
        if env.model_version != ctx.version:
            if received is not None:
                ctx.inbox.reject(
                    received.delivery,
                    "wrong-base",
                    f"trained from version {env.model_version}, current is {ctx.version}",
                )
            return
        update = ctx.fold(stats, strategy, Arrival(env, len(body), ctx.global_state, received=received))
        if update is None:
            return
        ctx.guard.note(update, ctx.global_state)
        if received is not None:
            ctx.spool.save_update(stats.round, env.client, body)
        ctx.note_trained_from(env.client, env.model_version)
        stats.update_ids[env.client] = env.msg_id
        stats.reported.setdefault(env.client, float(env.payload["loss"]))
        if received is not None:
            ctx.inbox.ack(received)

    def _take_report(self, msg: Received) -> None:
        env, stats = msg.env, self.stats
        if env.client in stats.reported:
            self.ctx.inbox.drop(msg, "duplicate")
            return
        stats.reported[env.client] = float(env.payload["loss"])
        stats.bytes_up += msg.size
        self._save(None, None)
        self.ctx.inbox.ack(msg)

    def _mediate(self) -> Strategy:
        ctx, cfg, stats = self.ctx, self.cfg, self.stats
        stats.granted = (
            ctx.mediator.top_k(stats.reported, cfg.beta) if cfg.beta < 1 else sorted(stats.reported)
        )
        choice = self._choose()
        self._save(stats.granted, choice)
        if self._publish_grant(stats.granted):
            self._save(stats.granted, choice)
        log.info("uploads granted", round=stats.round, granted=len(stats.granted), strategy=choice)
        return ctx.begin_strategy(stats, choice)

    def _choose(self) -> str:
        """The round's strategy: the job's, or plain FedAvg where its plan has the loss switch say so
        (FedMed)."""
        if not self.cfg.plan.loss_switch:
            return self.cfg.strategy
        losses = self.stats.reported.values()
        mean_loss = math.fsum(losses) / len(losses)  # fsum: exact, so order-free
        return self.cfg.strategy if self.ctx.mediator.choose(mean_loss) == "adaptive" else FedAvg.name

    def _publish_grant(self, granted: list[str]) -> bool:
        """Publish the grant to every selected agent; True when one could not be reached (it is left out)."""
        ctx, stats = self.ctx, self.stats
        env = messages.grant(self.cfg.job, stats.round, ctx.version, granted)
        body = messages.encode(env)
        left_out = False
        recipients = ctx.recipients(stats.selected)  # granted or not, a selected agent waits for the word
        for to, clients in recipients.items():
            try:
                ctx.broker.publish(topology.rk_grant(self.cfg.job, to), body, message_id=env.msg_id)
            except Undeliverable as exc:  # its control queue is gone: it loses its place, not the job
                for client in clients:
                    ctx.leave_out(stats, client, f"grant undeliverable: {exc}")
                left_out = True
        stats.bytes_down += len(body) * len(recipients)
        ctx.phase = "uploading"
        return left_out

    def _save(self, granted: list[str] | None, choice: str | None) -> None:
        stats = self.stats
        self.ctx.spool.save_state(
            stats.round,
            {
                "selected": stats.selected,
                "hosts": {c: self.ctx.hosted[c] for c in stats.selected if c in self.ctx.hosted},
                "unreachable": stats.unreachable,
                "reported": stats.reported,
                "granted": granted,
                "strategy": choice,
            },
        )
