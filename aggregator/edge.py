"""An edge aggregator (two-tier aggregation, docs/guide/edges.md; `fedmq aggregator run --tier edge`).

It consumes its own queue (topology.q_edge): the updates of the clients that ``topology.edge_of`` routes to
it, and the root's edge-round, which names the round's clients routed here, how long to wait for them and
the exact model they trained from. It spools each update as it came and acks it; once every named client
has sent one (or the wait is over) it folds them in the order the root named them, through the round's
strategy and the per-update guards (aggregator.guards), and sends the root the strategy's partial sum
(Strategy.partial). Memory: one decoded update and the strategy's sums at a time, whatever the cohort.

An edge keeps nothing across a restart: one that dies loses its clients' round (the root closes the round
without them), and the next edge-round starts afresh.
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
from fedmq.aggregator.guards import RoundGuard
from fedmq.aggregator.inbox import EDGE_KINDS, Inbox, Received
from fedmq.aggregator.spool import RoundSpool
from fedmq.aggregator.strategies.base import ClientUpdate, State, Strategy
from fedmq.aggregator.strategies.registry import round_strategy, strategy_class, strategy_from_config
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
# updates of rounds whose edge-round has not come yet are spooled, at most this many rounds' worth
EARLY_UPDATES = 2


class EdgeRound:
    """The round an edge has open: what the root said of it, and the updates spooled so far."""

    def __init__(self, env: Envelope, base: State) -> None:
        self.round, self.version = env.round, env.model_version
        self.clients: list[str] = list(env.payload["clients"])
        self.strategy: str = env.payload["strategy"]
        self.deadline = time.time() + float(env.payload["deadline_s"])
        self.base = base
        self.arrived: set[str] = set()

    def complete(self) -> bool:
        return set(self.clients) <= self.arrived or time.time() >= self.deadline


class Edge:
    """Folds the updates of the clients routed to edge ``index`` of ``cfg.job``, round by round, until
    ``stop`` is set."""

    def __init__(
        self, broker: Broker, task: Task, cfg: JobConfig, index: int, state_dir: Path, durable: bool = True
    ) -> None:
        if not 0 <= index < max(cfg.edges, 1) or not cfg.edges:
            raise FedmqError(f"edge {index}: the job has {cfg.edges} edge(s) (edges = N, --edges N)")
        self.broker, self.cfg, self.index = broker, cfg, index
        self.name = topology.edge_name(index)
        model = task.build_model(cfg.seed)
        state = model_state(model)
        hook = strategy_class(cfg.strategy).client_hook
        extras = hook.extra_tensors(list(state)) if hook is not None else {}
        self.manifest: Manifest = task.manifest(model).extended(extras)
        self.inbox = Inbox(
            broker, cfg.job, cfg.identity, Limits.for_model(self.manifest.message_bound), kinds=EDGE_KINDS
        )
        # its own folder, so that it may share a state dir with the root or other edges
        spool_dir = Path(state_dir) / "edges" / self.name
        shutil.rmtree(spool_dir, ignore_errors=True)  # a restarted edge keeps nothing
        self.spool = RoundSpool(spool_dir, durable)
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
        self.broker.declare_job(self.cfg.job, [], inbox=True, edges=(self.index,))
        tag = self.inbox.subscribe(topology.q_edge(self.cfg.job, self.index), prefetch=self._prefetch())
        self._subscribed = True
        log.info("edge aggregator ready", job=self.cfg.job, edge=self.name)
        try:
            while not self.stop.is_set():
                if self.open is not None and self.open.complete():
                    self._close()
                    continue
                msg = self.inbox.next(0.5)
                if msg is not None:
                    self._dispatch(msg)
        finally:
            self.broker.cancel(tag)
        return self.partials

    def _prefetch(self) -> int:
        return min(65535, max(64, self.cfg.most_selected() + 16))

    @property
    def started(self) -> bool:
        """Subscribed to its queue (a signal before this ends the process at once)."""
        return self._subscribed

    def _dispatch(self, msg: Received) -> None:
        env = msg.env
        if env.kind is Kind.END:  # the job ran all its rounds
            log.info("job ended: edge aggregator leaves", edge=self.name, rounds=env.payload["rounds"])
            self.inbox.ack(msg)
            self.ended = True
            self.stop.set()
        elif env.kind is Kind.EDGE_ROUND:
            self._on_edge_round(msg)
        elif env.round <= self.closed_upto:
            self.inbox.drop(msg, "stale-round")
        elif self.open is not None and env.round == self.open.round:
            if env.client not in self.open.clients:
                self.inbox.drop(msg, "not-routed-here")
            elif env.client in self.open.arrived:
                self.inbox.drop(msg, "duplicate")
            else:
                self._keep(msg, self.open.arrived)
        elif self.open is not None and env.round < self.open.round:
            self.inbox.drop(msg, "stale-round")
        elif sum(map(len, self.early.values())) >= EARLY_UPDATES * self.cfg.most_selected():
            self.inbox.drop(msg, "future-round")
        else:  # its edge-round has not come yet (this edge just started, or the update overtook it)
            early = self.early.setdefault(env.round, set())
            if env.client in early:
                self.inbox.drop(msg, "duplicate")
            elif topology.edge_of(env.client, self.cfg.edges) != self.index:
                self.inbox.drop(msg, "not-routed-here")
            else:
                self._keep(msg, early)

    def _keep(self, msg: Received, into: set[str]) -> None:
        """Spool an update as it came, then ack it: it is folded when its round closes."""
        self.spool.save_update(msg.env.round, msg.env.client, msg.delivery.body)
        into.add(msg.env.client)
        self.inbox.ack(msg)

    def _on_edge_round(self, msg: Received) -> None:
        env = msg.env
        if env.round <= self.closed_upto:
            self.inbox.drop(msg, "stale-round")
            return
        if self.open is not None and env.round == self.open.round:  # some of its clients went offline
            named = set(env.payload["clients"])
            self.open.clients = [c for c in self.open.clients if c in named]
            self.inbox.ack(msg)
            return
        if self.open is not None:  # the root moved on: the open round closed without this edge
            log.warning("round given up: the root has moved on", edge=self.name, round=self.open.round)
            self._forget(self.open.round)
        try:
            sums = strategy_class(round_strategy(env.payload["strategy"], self.cfg)).partial_sums
        except FedmqError:
            sums = False
        if not sums:
            why = f"{env.payload['strategy']!r} has no partial sums"
            self.inbox.reject(msg.delivery, "bad-strategy", why)
            self._forget(env.round)
            return
        base = self._model(env)
        if base is None:  # this round's clients are lost to it; the root closes without them
            self.inbox.drop(msg, "model-not-fetched")
            self._forget(env.round)
            return
        self.open = EdgeRound(env, base)
        self.open.arrived = {c for c in self.early.pop(env.round, set()) if c in self.open.clients}
        self.inbox.ack(msg)
        log.info("edge round open", edge=self.name, round=env.round, clients=len(self.open.clients))

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

    def _forget(self, rnd: int) -> None:
        self.spool.clear_upto(rnd)
        self.early = {r: c for r, c in self.early.items() if r > rnd}
        self.closed_upto = max(self.closed_upto, rnd)
        self.open = None if self.open is not None and self.open.round <= rnd else self.open

    def _close(self) -> None:
        """Fold the open round's updates in the root's order and send the partial sum."""
        rnd = self.open
        assert rnd is not None
        strategy, facts, failed, nbytes = self._fold_all(rnd, dropped=set(), capped={})
        verdict = self.guard.verdict()
        if verdict:  # out of bounds: fold again without them, or with their weight capped
            log.warning(
                "updates out of bounds: folded again without them", edge=self.name, **verdict.record()
            )
            strategy, facts, failed, nbytes = self._fold_all(rnd, set(verdict.dropped), verdict.capped)
            failed = sorted({*failed, *verdict.dropped})
        env = partial_message(
            self.cfg.job, rnd.round, self.name, rnd.version, strategy.partial(), facts, failed, nbytes
        )
        self.broker.publish(
            topology.rk_partial(self.cfg.job, self.index), messages.encode(env), message_id=env.msg_id
        )
        self.partials += 1
        log.info("partial sum sent", edge=self.name, round=rnd.round, folded=len(facts), failed=len(failed))
        self._forget(rnd.round)

    def _fold_all(
        self, rnd: EdgeRound, dropped: set[str], capped: dict[str, int]
    ) -> tuple[Strategy, dict[str, list], list[str], list[int]]:
        """Fold the spooled updates of ``rnd`` in order; (strategy, client -> [loss, n, id], failed,
        [wire bytes, raw bytes])."""
        _, strategy = strategy_from_config(rnd.strategy, self.cfg)
        strategy.begin(rnd.base)
        self.guard.begin()
        facts: dict[str, list] = {}
        failed: list[str] = []
        nbytes = [0, 0]
        for client in rnd.clients:
            body = self.spool.read_update(rnd.round, client) if client in rnd.arrived else None
            if body is None or client in dropped:
                continue
            update = self._decoded(body, rnd, client, capped.get(client))
            if update is None:
                failed.append(client)
                continue
            try:
                strategy.fold(update)
            except (FedmqError, ValueError, TypeError, RuntimeError) as exc:
                self.inbox.count_rejection("rejected-by-strategy", f"{client}: {exc}")
                failed.append(client)
                continue
            self.guard.note(update, rnd.base)
            facts[client] = [float(update.loss or 0.0), int(update.n_samples), update.update_id]
            nbytes[0] += len(body)
            nbytes[1] += raw_nbytes(update.tensors)
        return strategy, facts, failed, nbytes

    def _decoded(self, body: bytes, rnd: EdgeRound, client: str, n: int | None) -> ClientUpdate | None:
        try:
            env = messages.decode(body, limits=self.inbox.limits)
            if env.client != client or env.round != rnd.round or env.kind is not Kind.UPDATE:
                raise CodecError("unexpected", "spooled update is another's")
            if env.model_version != rnd.version:
                raise CodecError("wrong-base", f"trained from version {env.model_version}, not {rnd.version}")
            return decode_update(env, self.manifest, rnd.base, n_samples=n)
        except CodecError as exc:
            self.inbox.count_rejection(exc.reason, f"{client}: {exc}")
            return None
