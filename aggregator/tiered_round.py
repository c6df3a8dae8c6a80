"""A synchronous round over edge aggregators (two-tier aggregation, docs/guide/edges.md): the root selects,
announces and (with a grant phase) grants as in aggregator.sync_round, but its agents upload to the edge
that ``topology.edge_of`` routes them to. The root tells each edge its clients (edge-round); each edge folds
its clients' updates into a partial sum (aggregator.edge) and sends it here, and the root folds the partial
sums into the round's strategy (Strategy.fold_partial) in the order of the edges, whatever order they come
in, so the same seed gives the same model bit for bit. An edge that dies loses only its clients' round: the
root closes the round with the partials it has once the round's deadline and EDGE_GRACE_S have passed.

Crash safety is the synchronous round's: a partial is spooled under its edge's name before it is acked, a
restarted root folds the spooled partials again in order and tells the edges again (an edge that already
sent its partial ignores it).
"""

from __future__ import annotations

import time

import structlog

from fedmq.aggregator.inbox import Received
from fedmq.aggregator.rounds import Arrival, RoundContext
from fedmq.aggregator.strategies.base import Strategy
from fedmq.aggregator.sync_round import SyncRound
from fedmq.broker.transport import topology
from fedmq.broker.wire.envelope import Envelope, Kind

log = structlog.get_logger(__name__)

# how long past the round's deadline the root waits for the edges' partial sums: an edge closes at the
# deadline, then folds what it took and sends it
EDGE_GRACE_S = 10.0


class TieredRound(SyncRound):
    """The engine's open round with ``cfg.edges`` edge aggregators; its fold units are the edges."""

    unit_kind = Kind.PARTIAL

    def __init__(self, ctx: RoundContext) -> None:
        super().__init__(ctx)
        self.routed: dict[str, list[str]] = {}  # edge name -> its granted clients, in fold order
        self.allowed: dict[str, set[str]] = {}  # edge name -> the clients its partial may name
        self.edge_index: dict[str, int] = {}
        self.told: set[str] = set()  # edges told of this round (each reads the exact model once)
        self.done: set[str] = set()  # edges whose partial was folded or rejected
        self.folded: set[str] = set()  # edges whose partial was folded
        self.deadline = 0.0

    def _route(self) -> None:
        """Which edge folds which granted client; the edges with none take no part."""
        by_edge: dict[int, list[str]] = {}
        for client in self.stats.granted:
            by_edge.setdefault(topology.edge_of(client, self.cfg.edges), []).append(client)
        self.routed = {topology.edge_name(e): by_edge[e] for e in sorted(by_edge)}
        self.edge_index = {topology.edge_name(e): e for e in by_edge}
        # what a partial may name: also the clients left out since (unreachable after a restart), whose
        # updates the edge may have folded before
        self.allowed = {name: set(clients) for name, clients in self.routed.items()}
        for client in self.stats.unreachable:
            name = topology.edge_name(topology.edge_of(client, self.cfg.edges))
            if name in self.allowed:
                self.allowed[name].add(client)

    def _tell_edges(self, names: list[str] | None = None) -> None:
        """Tell the edges ``names`` (default: all of the round's) their clients still expected."""
        left = max(self.deadline - time.time(), 1.0)
        for name in names if names is not None else list(self.routed):
            if name in self.done or name in self.parked:
                continue
            clients = [c for c in self.routed[name] if c not in self.gone]
            self.ctx.tell_edge(self.stats, self.edge_index[name], clients, left, name not in self.told)
            self.told.add(name)

    def _collect(self, spooled_updates: list[str]) -> Strategy | None:
        """Reports and grants as in a synchronous round; then the edges' partial sums."""
        ctx, cfg, stats = self.ctx, self.cfg, self.stats
        now = time.time()
        self.deadline = now + (0.0 if cfg.grant_phase else cfg.report_deadline_s) + cfg.update_deadline_s
        strategy = self._begin_granted()
        if strategy is not None:
            self._route()
            self.parked.update(u for u in spooled_updates if u in self.routed)
            self._fold_in_order(strategy, closing=self.closed)
        if self.closed:  # it closed before the restart: with what its spool holds, and nothing more
            return strategy
        if strategy is not None:
            if self.saved_granted is not None:
                self.deadline = now + cfg.update_deadline_s
            self._tell_edges()
        report_deadline = now + cfg.report_deadline_s
        while not ctx.stop.is_set():
            if strategy is None and self._reports_done(report_deadline):
                if len(stats.reported) < cfg.min_clients:
                    return None
                strategy = self._mediate()
                self._route()
                self.deadline = time.time() + cfg.update_deadline_s
                self._tell_edges()
            if strategy is not None and (
                self.done | self.parked >= set(self.routed) or time.time() >= self.deadline + EDGE_GRACE_S
            ):
                self._fold_in_order(strategy, closing=True)
                return strategy
            due = strategy is not None and self._turn() in self.parked
            wait = report_deadline if strategy is None else self.deadline + EDGE_GRACE_S
            msg = ctx.inbox.next(0.0 if due else min(0.5, max(wait - time.time(), 0.0)))
            if msg is not None:
                self._dispatch(msg, strategy)
            elif strategy is not None and due:
                self._fold_in_order(strategy, at_most=1)
        return strategy  # stopped: spooled partials stay for the next aggregator

    def _dispatch(self, msg: Received, strategy: Strategy | None) -> None:
        ctx, stats, env = self.ctx, self.stats, msg.env
        if env.kind is Kind.PARTIAL:
            if env.round != stats.round:
                ctx.inbox.drop(msg, "stale-round" if env.round < stats.round else "future-round")
            elif strategy is None or env.client not in self.routed:
                ctx.inbox.drop(msg, "not-an-edge-of-the-round")
            elif env.client in self.done or env.client in self.parked:
                ctx.inbox.drop(msg, "duplicate")
            else:
                self._take_partial(strategy, msg)
        elif env.kind is Kind.UPDATE:  # the round's updates go to the edges
            ctx.inbox.drop(msg, "update-for-an-edge")
        else:
            gone = set(self.gone)
            super()._dispatch(msg, strategy)
            if strategy is not None and self.gone - gone:  # their edges need not wait for them
                newly = self.gone - gone
                self._tell_edges([e for e, clients in self.routed.items() if newly & set(clients)])

    def _take_partial(self, strategy: Strategy, msg: Received) -> None:
        """Fold a partial now if its edge's turn has come, else spool it as it came and ack it (parked)."""
        ctx, env = self.ctx, msg.env
        if self._turn() == env.client or env.model_version != ctx.version:
            self._fold(strategy, env, msg.delivery.body, msg)
            return
        self._park(msg)

    def _turn(self) -> str | None:
        return next((e for e in self.routed if e not in self.done), None)

    def _fold_in_order(self, strategy: Strategy, closing: bool = False, at_most: int | None = None) -> None:
        """Fold parked partials in the order of the edges (sync_round's _fold_in_order over edges)."""
        folded = 0
        for edge in self.routed:
            if edge in self.done:
                continue
            if edge in self.parked:
                if at_most is not None and folded >= at_most:
                    return
                folded += 1
                self.parked.discard(edge)
                self.done.add(edge)
                self._fold_parked(strategy, edge)
            elif not closing:
                return

    def _folded(self, unit: str) -> bool:
        return unit in self.folded

    def _fold(  # type: ignore[override]
        self,
        strategy: Strategy,
        env: Envelope,
        body: bytes,
        received: Received | None = None,
        parked: bool = False,
    ) -> bool:
        """Fold one partial, live (``received``: then spooled and acked) or from the spool; True if folded."""
        ctx, stats = self.ctx, self.stats
        self.done.add(env.client)
        if self._wrong_base(env, received, parked):
            return False
        arrival = Arrival(env, len(body), ctx.global_state, received=received, parked=parked)
        if not ctx.fold_partial(stats, strategy, arrival, self.allowed[env.client]):
            return False
        self.folded.add(env.client)
        if received is not None:
            ctx.spool.save_update(stats.round, env.client, body)
            ctx.inbox.ack(received)
        folded = len(env.payload["clients"])
        log.info("partial sum folded", round=stats.round, edge=env.client, clients=folded)
        return True
