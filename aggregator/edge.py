"""An edge aggregator (two-tier aggregation, docs/guide/edges.md; `fedmq aggregator run --tier edge`).

It consumes its own queue (topology.q_edge): the updates of the clients that ``topology.edge_of`` routes to
it, and the root's edge-round, which names the round's clients routed here (in the order to fold them), how
long to wait for them and the exact model they trained from. It spools each update as it came and acks it,
and folds the updates in the root's order as that order allows (an update that came ahead of its turn waits
on the spool), through the round's strategy and the per-update guards (aggregator.guards). Once every named
client has sent one (or the wait is over) it folds what is left and sends the root the strategy's partial sum
(Strategy.partial), with each client it could not fold and why, and what its guard decided. Memory: one
decoded update and the strategy's sums at a time, whatever the edge's share of the cohort.

Its queue has one active consumer: a second edge of the same number waits as a hot standby. An edge keeps
nothing across a restart: one that dies loses its clients' round (the root closes the round without them),
and the next edge-round starts afresh.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import structlog
import torch

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.decoding import decode_update, partial_message
from fedmq.aggregator.guards import RoundGuard, Verdict, in_fold_order
from fedmq.aggregator.inbox import EDGE_KINDS, Inbox, Received, upload_prefetch, upload_reassembly
from fedmq.aggregator.spool import RoundSpool
from fedmq.aggregator.strategies.base import ClientUpdate, PartialSum, State, Strategy
from fedmq.aggregator.strategies.registry import (
    round_strategy,
    strategy_class,
    strategy_extras,
    strategy_from_config,
)
from fedmq.broker.transport import topology
from fedmq.broker.transport.base import Broker
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.wire import messages
from fedmq.broker.wire.encodings import decode_state, raw_nbytes
from fedmq.broker.wire.envelope import Envelope, Kind, Limits
from fedmq.errors import CodecError, FedmqError
from fedmq.manifest import Manifest
from fedmq.tasks.base import Task, model_state

log = structlog.get_logger(__name__)

MODEL_FETCH_S = 60.0  # the exact model is in the stream before the edge-round is sent
# updates of a round whose edge-round has not come yet are spooled for at most this many rounds ahead
EARLY_ROUNDS = 2
# an edge closes its round early enough to fold what waits behind a client that never came before the
# root's deadline: by the updates waiting × the time one fold took (a running mean), and this margin
CLOSE_MARGIN_S = 1.0


class EdgeRound:
    """The round an edge has open: what the root said of it, the updates spooled so far, and the fold."""

    def __init__(self, env: Envelope, base: State, strategy: Strategy) -> None:
        self.round, self.version = env.round, env.model_version
        self.clients: list[str] = list(env.payload["clients"])  # the fold order
        self.expected: set[str] = set(self.clients)  # those still awaited (the root says who went offline)
        self.strategy_name: str = env.payload["strategy"]
        wait = float(env.payload["deadline_s"])
        # the root's deadline: from when it sent this, or (a clock behind the root's) from now
        self.deadline = min(time.time() + wait, env.sent_at + wait)
        self.base = base
        self.strategy = strategy
        self.arrived: set[str] = set()  # spooled
        self.done: set[str] = set()  # folded or refused
        self.turn = 0  # the index in ``clients`` of the next to fold
        self.facts: dict[str, list] = {}  # client -> [loss, n_samples, update id] of each one folded
        self.failed: dict[str, str] = {}  # client -> why it was not folded
        self.nbytes = [0, 0]  # wire and raw bytes of the folded updates
        self.fold_s = 0.0  # the running mean of one update's fold (decode, checks, fold), in seconds

    def complete(self) -> bool:
        """Every expected client's update is here, or the time left is what folding the waiting ones takes."""
        waiting = len(self.arrived - self.done)
        return self.expected <= self.arrived or time.time() >= (
            self.deadline - waiting * self.fold_s - CLOSE_MARGIN_S
        )


class Edge:
    """Folds the updates of the clients routed to edge ``index`` of ``cfg.job``, round by round, until
    ``stop`` is set or the job ends."""

    def __init__(self, broker: Broker, task: Task, cfg: JobConfig, index: int, state_dir: Path) -> None:
        if not cfg.edges or not 0 <= index < cfg.edges:
            raise FedmqError(f"edge {index}: the job has {cfg.edges} edge(s) (edges = N, --edges N)")
        self.broker, self.cfg, self.index = broker, cfg, index
        self.name = topology.edge_name(index)
        model = task.build_model(cfg.seed)
        extras = strategy_extras(cfg.strategy, list(model_state(model)))
        self.manifest: Manifest = task.manifest(model).extended(extras)
        self.inbox = Inbox(
            broker, cfg.job, cfg.identity, Limits.for_model(self.manifest.message_bound), kinds=EDGE_KINDS
        )
        # its own folder, so that it may share a state dir with the root or other edges; not durable: a
        # restarted edge keeps nothing of it
        self.spool_dir = Path(state_dir) / "edges" / self.name
        self.spool = RoundSpool(self.spool_dir, durable=False)
        self.guard = RoundGuard(cfg.max_samples_factor, cfg.norm_bound_factor)
        self.stop = threading.Event()
        self.open: EdgeRound | None = None
        self.closed_upto = 0  # the newest round this edge has sent (or given up) its partial for
        self.early: dict[int, set[str]] = {}  # round -> clients whose update came before its edge-round
        self.partials = 0  # partial sums sent
        self.ended = False  # the root said the job is over
        self._subscribed = False

    def run(self) -> int:
        """Consume the edge's queue until ``stop`` or the job's end; the number of partial sums sent."""
        cfg, uploaders = self.cfg, self.cfg.most_selected()
        self.broker.declare_job(cfg.job, [], inbox=True, edges=(self.index,))
        tag = self.inbox.subscribe(
            topology.q_edge(cfg.job, self.index),
            prefetch=upload_prefetch(self.broker, self.manifest.message_bound, uploaders),
            reassembly=upload_reassembly(self.inbox.limits.max_message_bytes, uploaders),
        )
        self._subscribed = True
        log.info("edge aggregator waiting (a hot standby waits here while another is active)", edge=self.name)
        try:
            if not self.inbox.wait_first(self.stop):
                return self.partials
            shutil.rmtree(self.spool_dir, ignore_errors=True)  # the active edge: what a dead one left goes
            log.info("edge aggregator active", job=cfg.job, edge=self.name)
            try:
                self._serve()
            finally:
                self.spool.drop_free()  # the active edge's own: a standby never touches the folder
        finally:
            self.broker.cancel(tag)
        return self.partials

    def _serve(self) -> None:
        while not self.stop.is_set():
            if self.open is not None and self.open.complete():
                self._close()
                continue
            msg = self.inbox.next(0.5)
            if msg is not None:
                self._dispatch(msg)

    @property
    def started(self) -> bool:
        """Subscribed to its queue (a signal before this ends the process at once)."""
        return self._subscribed

    # ------------------------------------------------------------------ messages
    def _dispatch(self, msg: Received) -> None:
        env, rnd = msg.env, self.open
        if env.kind is Kind.END:  # the job ran all its rounds
            log.info("job ended: edge aggregator leaves", edge=self.name, rounds=env.payload["rounds"])
            self.inbox.ack(msg)
            self.ended = True
            self.stop.set()
        elif env.kind is Kind.EDGE_ROUND:
            self._on_edge_round(msg)
        elif env.round <= self.closed_upto or (rnd is not None and env.round < rnd.round):
            self.inbox.drop(msg, "stale-round")
        elif rnd is not None and env.round == rnd.round:
            if env.client not in rnd.clients:
                self.inbox.drop(msg, "not-routed-here")
            elif env.client in rnd.arrived:
                self.inbox.drop(msg, "duplicate")
            else:
                self._keep(msg, rnd.arrived)
                self._advance(rnd, {env.client: msg.delivery.body})
        else:  # its edge-round has not come yet (the update overtook it, or this edge just started)
            early = self.early.get(env.round, set())
            if topology.edge_of(env.client, self.cfg.edges) != self.index:
                self.inbox.drop(msg, "not-routed-here")
            elif env.round > (rnd.round if rnd is not None else self.closed_upto) + EARLY_ROUNDS:
                self.inbox.drop(msg, "future-round")
            elif env.client in early:
                self.inbox.drop(msg, "duplicate")
            elif len(early) >= self.cfg.most_selected():
                self.inbox.drop(msg, "over-the-cohort")
            else:
                self._keep(msg, self.early.setdefault(env.round, early))

    def _keep(self, msg: Received, into: set[str]) -> None:
        """Spool an update as it came, then ack it."""
        self.spool.save_update(msg.env.round, msg.env.client, msg.delivery.body)
        into.add(msg.env.client)
        self.inbox.ack(msg)

    def _on_edge_round(self, msg: Received) -> None:
        env, rnd = msg.env, self.open
        if env.round <= self.closed_upto or (rnd is not None and env.round < rnd.round):
            self.inbox.drop(msg, "stale-round")
            return
        if rnd is not None and env.round == rnd.round:  # some of its clients went offline: wait less
            rnd.expected &= set(env.payload["clients"])
            self.inbox.ack(msg)
            self._advance(rnd)
            return
        if rnd is not None:  # the root moved on: the open round closed without this edge
            log.warning("round given up: the root has moved on", edge=self.name, round=rnd.round)
            self._forget(rnd.round)
        self.inbox.ack(msg)
        try:
            name = round_strategy(env.payload["strategy"], self.cfg)
            usable = strategy_class(name).partial_sums
        except FedmqError:
            usable = False
        base = self._model(env) if usable else None
        if base is None:  # nothing can be folded: the root hears so at once and need not wait
            self._give_up(env, "model-not-fetched" if usable else "strategy-without-partial-sums")
            return
        _, strategy = strategy_from_config(env.payload["strategy"], self.cfg)
        strategy.begin(base)
        self.guard.begin()
        self.guard.expect([])  # the history's cap, if any, applied as the round folds
        self.open = rnd = EdgeRound(env, base, strategy)
        rnd.arrived = self.early.pop(env.round, set()) & set(rnd.clients)
        log.info("edge round open", edge=self.name, round=env.round, clients=len(rnd.clients))
        self._advance(rnd)

    def _model(self, env: Envelope) -> State | None:
        """The exact model the edge-round names, from the job's model stream."""
        entry = env.payload["model"]
        try:
            delivery = self.broker.fetch(
                topology.q_models(self.cfg.job), entry["id"], offset=entry["since"], timeout=MODEL_FETCH_S
            )
            menv = messages.decode(delivery.body)
            if menv.kind is not Kind.MODEL or menv.model_version != env.model_version:
                raise CodecError("unexpected", f"{menv.kind.value} is not model v{env.model_version}")
            tensors = decode_state(menv.payload["tensors"], self.manifest, None)
        except (BrokerError, CodecError) as exc:
            log.warning("model of the round not fetched", edge=self.name, round=env.round, error=str(exc))
            return None
        if len(tensors) != len(self.manifest):
            log.warning("model of the round incomplete", edge=self.name, round=env.round)
            return None
        return {k: torch.from_numpy(v) for k, v in tensors.items()}

    # ------------------------------------------------------------------ folding
    def _advance(self, rnd: EdgeRound, bodies: dict[str, bytes] | None = None) -> None:
        """Fold the updates whose turn has come: in the root's order, past the clients that went offline."""
        while rnd.turn < len(rnd.clients):
            client = rnd.clients[rnd.turn]
            if client in rnd.arrived:
                self._fold(rnd, client, (bodies or {}).get(client))
            elif client in rnd.expected:
                return
            rnd.turn += 1

    def _fold(
        self, rnd: EdgeRound, client: str, body: bytes | None = None, verdict: Verdict | None = None
    ) -> None:
        """Fold one spooled update into ``rnd``'s strategy, its weight capped ahead (RoundGuard.capped_ahead),
        or as ``verdict`` says when the round is folded again; one that is refused is named in
        ``rnd.failed``."""
        rnd.done.add(client)
        started = time.perf_counter()
        body = body if body is not None else self.spool.read_update(rnd.round, client)
        try:
            if body is None:
                raise CodecError("spool", "spooled update gone")
            update = self._decoded(body, rnd, client, None if verdict is None else verdict.capped.get(client))
            folded = self.guard.capped_ahead(update) if verdict is None else update
            rnd.strategy.fold(folded)
        except (FedmqError, ValueError, TypeError, RuntimeError) as exc:
            reason = exc.reason if isinstance(exc, CodecError) else "rejected-by-strategy"
            rnd.failed[client] = reason
            self.guard.applied.pop(client, None)  # not folded: no cap applied to it
            self.inbox.count_rejection(reason, f"{client}: {exc}")
            return
        self.guard.note(update, rnd.base)
        rnd.facts[client] = [float(update.loss or 0.0), int(folded.n_samples), update.update_id]
        rnd.nbytes[0] += len(body)
        rnd.nbytes[1] += raw_nbytes(update.tensors)
        rnd.fold_s += (time.perf_counter() - started - rnd.fold_s) / len(rnd.facts)

    def _decoded(self, body: bytes, rnd: EdgeRound, client: str, n: int | None) -> ClientUpdate:
        env = messages.decode(body, limits=self.inbox.limits)
        if env.client != client or env.round != rnd.round or env.kind is not Kind.UPDATE:
            raise CodecError("unexpected", "spooled update is another's")
        if env.model_version != rnd.version:
            raise CodecError("wrong-base", f"made from version {env.model_version}, not {rnd.version}")
        return decode_update(env, self.manifest, rnd.base, n_samples=n)

    def _close(self) -> None:
        """Fold what is left of the open round in the root's order and send the partial sum."""
        rnd = self.open
        assert rnd is not None
        for client in rnd.clients:  # behind a client that never came, or a late one of those gone offline
            if client in rnd.arrived and client not in rnd.done:
                self._fold(rnd, client)
        verdict = self.guard.verdict()
        # in the order folded: a late one of those counted gone offline came after later ones
        in_order = in_fold_order(list(rnd.facts), rnd.clients)
        if self.guard.refold_needed(verdict, in_order):  # out of bounds, or capped other than as folded
            log.warning("updates out of bounds: folded again", edge=self.name, **verdict.record())
            self._refold(rnd, verdict)
        env = partial_message(
            self.cfg.job,
            rnd.round,
            self.name,
            rnd.version,
            rnd.strategy.partial(),
            rnd.facts,
            {c: why for c, why in rnd.failed.items() if c not in verdict.dropped},
            rnd.nbytes,
            verdict.record(),
        )
        self._send(env)
        log.info("partial sum sent", edge=self.name, round=rnd.round, folded=len(rnd.facts))
        self._forget(rnd.round)

    def _refold(self, rnd: EdgeRound, verdict: Verdict) -> None:
        """Fold ``rnd`` again from the spool in the root's order, leaving the dropped out and capping n."""
        _, rnd.strategy = strategy_from_config(rnd.strategy_name, self.cfg)
        rnd.strategy.begin(rnd.base)
        rnd.done, rnd.facts, rnd.nbytes = set(), {}, [0, 0]
        for client in rnd.clients:
            if client in rnd.arrived and client not in verdict.dropped and client not in rnd.failed:
                self._fold(rnd, client, verdict=verdict)

    def _give_up(self, env: Envelope, why: str) -> None:
        """Tell the root at once that none of the round's clients can be folded here, and why."""
        clients = list(dict.fromkeys(env.payload["clients"]))
        log.warning("round given up", edge=self.name, round=env.round, reason=why)
        empty = PartialSum({}, {}, 0.0, {})
        failed = dict.fromkeys(clients, why)
        self._send(partial_message(self.cfg.job, env.round, self.name, env.model_version, empty, {}, failed))
        self._forget(env.round)

    def _send(self, env: Envelope) -> None:
        self.broker.publish(
            topology.rk_partial(self.cfg.job, self.index), messages.encode(env), message_id=env.msg_id
        )
        self.partials += 1

    def _forget(self, rnd: int) -> None:
        self.spool.clear_upto(rnd)
        self.early = {r: c for r, c in self.early.items() if r > rnd}
        self.closed_upto = max(self.closed_upto, rnd)
        self.open = None if self.open is not None and self.open.round <= rnd else self.open
