"""One synchronous round: select m agents, announce, collect reports, mediate and grant (when the
job has a grant phase), fold the granted updates in a fixed order, close.

Memory: updates are folded in the fixed order of the round's grant (see ``_fold_in_order``), so one that
arrives ahead of its turn must wait. It waits on disk, not in memory: it is spooled as it came off the wire
and acked at once, and read back when its turn comes; the one whose turn it is is folded straight from the
delivery. The engine thus holds one update's bytes and one decoded update at a time, whatever the cohort m,
and the sum is still taken in the same order, so the model is the same bit for bit. (An order-free exact
accumulator would also do, but costs several model-sized buffers and changes every strategy's arithmetic;
the update was spooled anyway, before its ack, so waiting on disk costs one read of bytes the page cache
usually still holds.)

Crash safety: the round's state (selected, reports, grants, the mediator's choice) and every update, folded
or waiting, are spooled before the message is acked (aggregator/spool.py); a restarted aggregator resumes the
open round from the spool, folding its updates in the same order, and re-publishes its announce (and its
grant, if decided): agents ignore rounds they already handled, and one whose announce or grant was lost with
the old aggregator gets it now.
"""

from __future__ import annotations

import math
import random
import time
from itertools import islice

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
        # granted updates that arrived ahead of their turn in the fold order: spooled and acked, read back
        # when their turn comes (none of them is in memory)
        self.parked: set[str] = set()
        self.gone: set[str] = set()  # selected agents that announced going offline: nothing more will come
        self.samples: dict[str, int] = {}  # client -> the n_k its report said (the guard caps weights ahead)
        # what the spool says of the round's grant and strategy choice (None: not decided yet), and whether
        # the round has closed: a restart then folds its spool again and closes it, announcing nothing
        self.saved_granted: list[str] | None = None
        self.saved_choice: str | None = None
        self.saved_mediator: dict | None = None  # the mediator's state once it chose (FedMed's loss switch)
        self.closed = False
        # stats.received as a set, how far into stats.granted every client was folded and how far into
        # stats.selected every client reported or went offline: the round's checks cost O(1) a message where
        # the scan of m clients they replace cost O(m) (O(m²) a round; O(m³) with the list's membership test)
        self._got: set[str] = set()
        self._got_of: tuple[list[str], int] = ([], 0)  # the list _got was made from, and its length then
        self._folded_upto: tuple[list[str], int] = ([], 0)  # stats.granted as scanned, and its prefix folded
        self._reported_upto: tuple[list[str], int] = ([], 0)  # stats.selected as scanned, and its prefix
        self._sets: dict[str, tuple[list[str], set[str]]] = {}  # "selected"/"granted": the list, as a set

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
            self.saved_granted, self.saved_choice = spooled.get("granted"), spooled.get("strategy")
            self.saved_mediator = spooled.get("mediator")
            if self.saved_mediator is not None:  # it chose before the restart: its step is taken, as then
                ctx.mediator.load_state_dict(self.saved_mediator)
            self.closed = bool(spooled.get("closed"))
            log.info(
                "resuming open round",
                round=stats.round,
                reported=len(stats.reported),
                spooled_updates=len(spooled_updates),
            )
            if stats.selected and not self.closed:
                # the old announce (or grant) may have died with the old aggregator: send again, and so
                # find again who can be reached (an agent whose queue is gone is left out of the round). A
                # closed round (its checkpoint was still being written) announces nothing: its agents
                # trained it already, and its spool holds every update it folded
                ctx.announce(stats)
                if self.saved_granted is not None and cfg.grant_phase:
                    self._publish_grant(self.saved_granted)
                if stats.unreachable != (spooled.get("unreachable") or {}):
                    if self.saved_granted is not None:
                        self.saved_granted = [c for c in self.saved_granted if c in stats.selected]
                    self._save()
        if not stats.selected:
            self._close_empty()
            return
        strategy = self._collect(spooled_updates)
        if ctx.stop.is_set():  # interrupted (Ctrl-C, SIGTERM): the round stays open in the spool for --resume
            return
        if not self.closed:
            self.closed = True
            self._save()
        ctx.close_round(stats, strategy)

    def _close_empty(self) -> None:
        """Close a round that selected nobody, saying why."""
        stats = self.stats
        why = "nobody reachable" if stats.unreachable else "nobody online"
        sampled = stats.online and self.cfg.dp != "none"  # DP's Poisson sampling drew nobody
        self.ctx.close_round(stats, None, skipped="nobody sampled" if sampled else why)

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
        self._save()
        if stats.selected:
            ctx.announce(stats)
            if stats.unreachable:  # the spool must not list as selected an agent that was left out
                self._save()

    def _collect(self, spooled_updates: list[str]) -> Strategy | None:
        """Reports, mediation, grants and updates of one round;
        returns the strategy holding the folded updates."""
        ctx, cfg, stats = self.ctx, self.cfg, self.stats
        strategy = self._begin_granted()
        if strategy is not None:  # the spool holds the updates taken before a restart: fold them in turn
            self.parked.update(c for c in spooled_updates if c in stats.granted)
            self._fold_in_order(strategy, closing=self.closed)
        if self.closed:  # it closed before the restart: with what its spool holds, and nothing more
            return strategy
        deadline = time.time() + (cfg.report_deadline_s if strategy is None else cfg.update_deadline_s)
        if strategy is not None and not cfg.grant_phase:
            deadline = time.time() + cfg.report_deadline_s + cfg.update_deadline_s
        while not ctx.stop.is_set():
            if strategy is None and self._reports_done(deadline):
                if len(stats.reported) < cfg.min_clients:
                    return None
                strategy = self._mediate()
                deadline = time.time() + cfg.update_deadline_s
            if strategy is not None and (self._all_in() or time.time() >= deadline):
                self._fold_in_order(strategy, closing=True)
                return strategy
            # a parked update whose turn has come waits while the inbox has deliveries: they are parked first
            due = strategy is not None and self._turn() in self.parked
            msg = ctx.inbox.next(0.0 if due else min(0.5, max(deadline - time.time(), 0.0)))
            if msg is not None:
                self._dispatch(msg, strategy)
            elif strategy is not None and due:
                self._fold_in_order(strategy, at_most=1)
        return strategy  # stopped: parked updates stay in the spool for the next aggregator

    def _begin_granted(self) -> Strategy | None:
        """The round's strategy, begun, where its uploads are known without waiting for reports (no grant
        phase, or a grant the spool kept), with ``stats.granted`` set; None while the grant is to come."""
        cfg, stats, granted = self.cfg, self.stats, self.saved_granted
        if granted is None and cfg.grant_phase:
            return None
        stats.granted = [
            c for c in (granted if granted is not None else stats.selected) if c in self._as_set("selected")
        ]
        return self._begin(self.saved_choice or cfg.strategy)

    def _reports_done(self, deadline: float) -> bool:
        """Every selected client reported or went offline, or the reports' time is over."""
        stats = self.stats
        selected, (of, i) = stats.selected, self._reported_upto
        i = i if of is selected else 0  # (a client left out makes a new list)
        while i < len(selected) and (selected[i] in stats.reported or selected[i] in self.gone):
            i += 1  # reports and departures only add up: the prefix stays settled
        self._reported_upto = (selected, i)
        return i >= len(selected) or time.time() >= deadline

    def _as_set(self, which: str) -> set[str]:
        """``stats.selected`` or ``stats.granted`` as a set, made again only when the list is replaced (they
        are never changed in place: a client left out makes new lists)."""
        clients = getattr(self.stats, which)
        cached = self._sets.get(which)
        if cached is None or cached[0] is not clients:
            cached = self._sets[which] = (clients, set(clients))
        return cached[1]

    def _received(self) -> set[str]:
        """``stats.received`` as a set, brought up to date with the list (which only grows in a round)."""
        got = self.stats.received
        seen_list, seen = self._got_of
        if seen_list is not got or len(got) < seen:
            self._got = set(got)
        else:
            self._got.update(got[seen:])
        self._got_of = (got, len(got))
        return self._got

    def _owed(self) -> islice:
        """``stats.granted`` from its first client not yet folded (the ones before stay folded)."""
        granted, got = self.stats.granted, self._received()
        of, i = self._folded_upto
        i = i if of is granted else 0
        while i < len(granted) and granted[i] in got:
            i += 1
        self._folded_upto = (granted, i)
        return islice(granted, i, None)

    def _all_in(self) -> bool:
        """Every granted client's update is folded or parked, or the client went offline."""
        got = self._received()
        return all(c in got or c in self.parked or c in self.gone for c in self._owed())

    def _screen(self, msg: Received) -> bool:
        """What every round takes the same way: a presence, a message of another round or from a client not
        selected, a report. True when ``msg`` was one of them (and is settled)."""
        ctx, stats, env = self.ctx, self.stats, msg.env
        if env.kind is Kind.PRESENCE:
            # the inbox is FIFO per agent (and host): its earlier report/update came first
            self.gone.update(c for c in ctx.note_presence(msg) if c in self._as_set("selected"))
        elif env.round != stats.round:
            ctx.inbox.drop(msg, "stale-round" if env.round < stats.round else "future-round")
        elif env.client not in self._as_set("selected"):
            ctx.inbox.drop(msg, "not-selected")
        elif env.kind is Kind.REPORT:
            self._take_report(msg)
        else:
            return False
        return True

    def _dispatch(self, msg: Received, strategy: Strategy | None) -> None:
        ctx, stats, env = self.ctx, self.stats, msg.env
        if self._screen(msg):
            return
        if env.client in self._received() or env.client in self.parked:
            ctx.inbox.drop(msg, "duplicate")
        elif strategy is None or env.client not in self._as_set("granted"):
            ctx.inbox.drop(msg, "not-granted")
        else:
            stats.failed.discard(env.client)  # a new try after a rejected update
            self._take_update(strategy, msg)

    def _take_update(self, strategy: Strategy, msg: Received) -> None:
        """A granted update: folded now if it is its turn, else spooled as it came and acked (parked)."""
        ctx, stats, env = self.ctx, self.stats, msg.env
        if self._turn() == env.client or env.model_version != ctx.version:  # a wrong base is rejected now
            self._fold(strategy, env, msg.delivery.body, msg)
            if env.client not in self._received():  # rejected: later clients need not wait for it
                stats.failed.add(env.client)
            return
        self._park(msg)

    def _park(self, msg: Received) -> None:
        """Spool a message ahead of its turn as it came and ack it: it is folded from the spool in turn."""
        ctx, env = self.ctx, msg.env
        ctx.spool.save_update(self.stats.round, env.client, msg.delivery.body)
        self.parked.add(env.client)
        ctx.inbox.ack(msg)
        ctx.took_update()

    def _turn(self) -> str | None:
        """The first client in fold order that is still owed (none before it is)."""
        stats, got = self.stats, self._received()
        return next(
            (c for c in self._owed() if c not in got and c not in stats.failed and c not in self.gone), None
        )

    def _fold_in_order(self, strategy: Strategy, closing: bool = False, at_most: int | None = None) -> None:
        """Fold parked updates (``at_most`` of them) in the order of ``stats.granted``, not in arrival order.

        Float sums depend on the order of their terms, so folding in a fixed order is what makes the same seed
        and config give the same model bit for bit whatever the broker and whoever trains fastest (a restart
        folds the spool in the same order). An update waits, parked on the spool (see the module docstring),
        until every client before it has been folded, has gone offline, or the round is closing. The live
        round folds one at a time between deliveries (``_collect``): when a slow client's update lets a long
        run of parked ones be folded, the updates that arrive meanwhile are parked, not left in memory.
        """
        stats = self.stats
        folded = 0
        for client in self._owed():
            if client in self._received() or client in stats.failed:
                continue
            if client in self.parked:
                if at_most is not None and folded >= at_most:
                    return
                folded += 1
                self.parked.discard(client)
                self._fold_parked(strategy, client)
                if client not in self._received():
                    # rejected: later clients need not wait for it (it may try again)
                    stats.failed.add(client)
            elif not (closing or client in self.gone):
                return

    # what the round folds, one message per fold unit: a client's update (a tiered round: an edge's partial)
    unit_kind = Kind.UPDATE

    def _fold_parked(self, strategy: Strategy, unit: str) -> None:
        """Fold a parked message, read back from the spool; one that is rejected is dropped from it."""
        rnd, what = self.stats.round, self.unit_kind.value
        body = self.ctx.spool.read_update(rnd, unit)
        try:
            if body is None:
                raise CodecError("spool", "file gone")
            env = messages.decode(body, limits=self.ctx.inbox.limits)
        except CodecError as exc:  # a damaged spool file: the unit is lost, the round goes on without it
            log.warning(f"spooled {what} unreadable: left out", round=rnd, unit=unit, error=str(exc))
            return
        if env.client != unit or env.round != rnd or env.kind is not self.unit_kind:
            log.warning(f"spooled {what} is another's: left out", round=rnd, unit=unit)
        else:
            self._fold(strategy, env, body, parked=True)
        if not self._folded(unit):
            self.ctx.spool.drop_update(rnd, unit)

    def _folded(self, unit: str) -> bool:
        return unit in self._received()

    def _wrong_base(self, env: Envelope, received: Received | None, parked: bool) -> bool:
        """Refuse (reject when live, count when parked) what was made from another version than the
        current one; True if refused."""
        ctx = self.ctx
        if env.model_version == ctx.version:
            return False
        why = f"made from version {env.model_version}, current is {ctx.version}"
        ctx.inbox.refuse(received, parked, "wrong-base", why)
        return True

    def _fold(
        self,
        strategy: Strategy,
        env: Envelope,
        body: bytes,
        received: Received | None = None,
        parked: bool = False,
    ) -> None:
        """Fold one update: live ``received`` (then spooled and acked), or read back from the spool
        (``parked``: acked already, so a rejection is counted, not settled)."""
        ctx, stats = self.ctx, self.stats
        if self._wrong_base(env, received, parked):
            return
        arrival = Arrival(env, len(body), ctx.global_state, received=received, parked=parked)
        update = ctx.fold(stats, strategy, arrival)
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
        self.samples[env.client] = int(env.payload["n_samples"])
        stats.bytes_up += msg.size
        self.ctx.spool.save_report(stats.round, env.client, stats.reported[env.client])
        self.ctx.inbox.ack(msg)

    def _mediate(self) -> Strategy:
        ctx, cfg, stats = self.ctx, self.cfg, self.stats
        stats.granted = (
            ctx.mediator.top_k(stats.reported, cfg.beta) if cfg.beta < 1 else sorted(stats.reported)
        )
        choice = self._choose()
        self.saved_granted, self.saved_choice = list(stats.granted), choice
        self.saved_mediator = ctx.mediator.state_dict() if cfg.plan.loss_switch else None
        self._save()
        if self._publish_grant(stats.granted):
            self.saved_granted = list(stats.granted)
            self._save()
        log.info("uploads granted", round=stats.round, granted=len(stats.granted), strategy=choice)
        return self._begin(choice)

    def _begin(self, choice: str) -> Strategy:
        """The round's strategy ``choice`` begun, and the guard told the weight cap it can apply as the
        granted clients' updates are folded (RoundGuard.expect: the history's, or their reports')."""
        strategy = self.ctx.begin_strategy(self.stats, choice)
        self.ctx.guard.expect([self.samples[c] for c in self.stats.granted if c in self.samples])
        return strategy

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

    def _save(self) -> None:
        self.ctx.spool.save_state(self.stats.round, self._state())

    def _state(self) -> dict:
        """The round's state as its spool keeps it."""
        stats = self.stats
        return {
            "selected": stats.selected,
            "hosts": {c: self.ctx.hosted[c] for c in stats.selected if c in self.ctx.hosted},
            "unreachable": stats.unreachable,
            "reported": stats.reported,
            "granted": self.saved_granted,
            "strategy": self.saved_choice,
            "mediator": self.saved_mediator,
            "closed": self.closed,
        }
