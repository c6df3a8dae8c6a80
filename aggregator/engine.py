"""The round engine: a job's lifecycle and state — presence (aggregator.presence), the global model and its
publication (aggregator.model_stream), the one fold path, closing a round (guards, evaluation, the run log,
checkpoints).

Why this file is longer than the others: it is the one owner of the job's state (the global model, its
version, the strategy's state, what was folded from whom), and every method left here reads or changes that
state in an order crash safety depends on (fold → record → checkpoint → next round). What only reads it
(who is online, publishing the model, the rounds themselves) lives in the modules named above.

One engine thread owns all state; the broker's dispatcher thread only queues deliveries (aggregator.inbox).
The rounds themselves run in aggregator.sync_round (the synchronous round) and aggregator.async_rounds
(fold every K arrivals with a staleness weight), through the engine's RoundContext (aggregator.rounds).
Crash safety: see aggregator/spool.py (ack after spooling) and aggregator/checkpoint.py (after every round).

Hot standby: several engines may consume the job's inbox (a single-active-consumer quorum queue); only the
active one receives deliveries. ``run`` therefore does nothing with the shared state dir until the first
delivery arrives: only then does it load the newest checkpoint and the open round's spool. A standby that
takes over after the active one died thus starts from exactly the state the dead one stored, and a standby
never writes to the state dir while it waits. The cost: an aggregator is idle until some agent speaks
(agents publish presence on join and every heartbeat, so an active aggregator hears from them at once).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

from fedmq.aggregator import secret_pool
from fedmq.aggregator.async_rounds import AsyncRounds, async_window
from fedmq.aggregator.checkpoint import (
    check_fresh_start,
    check_resumable,
    load_checkpoint,
    prepare_checkpoint,
)
from fedmq.aggregator.checkpoint_writer import CheckpointWriter
from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.decoding import decode_partial, decode_update
from fedmq.aggregator.guards import RoundGuard, Verdict, first_nonfinite, in_fold_order
from fedmq.aggregator.inbox import (
    HELD_A_CLIENT,
    MAX_PREFETCH,
    ROOT_KINDS,
    SECURE_KINDS,
    Inbox,
    Received,
    upload_prefetch,
    upload_reassembly,
)
from fedmq.aggregator.mediator import Mediator
from fedmq.aggregator.model_stream import Forms, ModelStream
from fedmq.aggregator.presence import Presence
from fedmq.aggregator.presence_budget import PresenceBudget
from fedmq.aggregator.privacy import dp_plan
from fedmq.aggregator.privacy_ledger import PrivacyLedger
from fedmq.aggregator.records import ONLINE_NAMES, RoundRecord, guard_summary, no_round_completed
from fedmq.aggregator.rounds import Arrival, RoundStats
from fedmq.aggregator.runlog import RunLog
from fedmq.aggregator.secure_buffers import SecureBuffers
from fedmq.aggregator.secure_round import SecureRound
from fedmq.aggregator.spool import RoundSpool
from fedmq.aggregator.strategies.base import ClientUpdate, State, Strategy
from fedmq.aggregator.strategies.private import Private
from fedmq.aggregator.strategies.registry import (
    client_map,
    strategy_extras,
    strategy_from_config,
)
from fedmq.aggregator.sync_round import SyncRound
from fedmq.aggregator.tiered_round import TieredRound
from fedmq.broker.transport import topology
from fedmq.broker.transport.base import Broker, ReassemblyLimits
from fedmq.broker.transport.errors import Undeliverable
from fedmq.broker.wire import messages
from fedmq.broker.wire.encodings import raw_nbytes
from fedmq.broker.wire.envelope import Envelope, Kind, Limits
from fedmq.broker.wire.malloc import Trimmer
from fedmq.errors import BadParameter, CodecError, FedmqError
from fedmq.files import replacing
from fedmq.manifest import Manifest
from fedmq.plugins import is_import_path
from fedmq.state_checks import state_problem
from fedmq.tasks.base import Task, load_state, model_state
from fedmq.tasks.training import resolve_device
from fedmq.train_config import TrainConfig

log = structlog.get_logger(__name__)

RELEASE_EVERY = 16  # parkings and folds between two returns of the heap's free pages (broker.wire.malloc)
RELEASE_GROWTH = 256 * 2**20  # ... once the process grew by more than this since the last return


class _OutOfBounds(Exception):
    """An asynchronous update the guard refused before folding (aggregator.guards.RoundGuard.screen)."""


class Engine:
    """Runs a job to completion (or until ``stop`` is set) and writes the run folder."""

    def __init__(
        self,
        broker: Broker,
        task: Task,
        cfg: JobConfig,
        run_dir: Path,
        *,
        durable: bool = True,
        evaluate: bool = True,
        on_round: Callable[[dict], None] | None = None,
        device: str = "cpu",
        noise_seed: int | None = None,
    ) -> None:
        self.broker = broker
        self.task = task
        self.cfg = cfg
        # a strategy that cannot be built (its parameters, a user's class) fails here, not at the first close
        _, probe = strategy_from_config(cfg.strategy, cfg)
        self.buffer_size, self.max_staleness = async_window(cfg, probe)
        if is_import_path(cfg.strategy) and not isinstance(cfg.train_config(), TrainConfig):
            raise BadParameter(f"strategy {cfg.strategy!r}: configure_train must return a TrainConfig")
        self.client = client_map(cfg)  # the strategy's client side, as every announcement names it
        self.run_dir = Path(run_dir)
        self.evaluate = evaluate
        # where validation and test run (the model lives on the CPU)
        self.eval_device = resolve_device(device)
        self.on_round = on_round
        self.stop = threading.Event()
        # its decoding limits are set below, from the manifest
        kinds = (*ROOT_KINDS, *SECURE_KINDS) if cfg.secagg else ROOT_KINDS  # a plain job refuses secagg's
        self.inbox = Inbox(broker, cfg.job, cfg.identity, kinds=kinds)
        self.spool = RoundSpool(self.run_dir / "spool", durable)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.runlog = RunLog(self.run_dir)
        self.mediator = Mediator(epsilon=cfg.loss_eps)
        # differential privacy (aggregator/privacy.py): the plan, the accountant, and where the noise comes
        # from (the OS CSPRNG; `fedmq simulate` alone passes the job's seed as ``noise_seed``)
        plan = dp_plan(cfg, self.buffer_size)
        self.privacy = PrivacyLedger(plan, noise_seed) if plan is not None else None
        self.noise_seed = noise_seed
        # under DP each update's norm is bounded by the clip norm, and a guard whose choice depends on the
        # other clients' norms would break that bound's analysis: the influence guard is off
        self.guard = (
            RoundGuard(0, 0) if self.privacy else RoundGuard(cfg.max_samples_factor, cfg.norm_bound_factor)
        )
        self.model = task.build_model(cfg.seed)
        self.global_state = {k: v.detach().clone().float() for k, v in model_state(self.model).items()}
        self.model_names = set(self.global_state)  # the task's tensors; the rest are the strategy's (extras)
        extras = strategy_extras(cfg.strategy, list(self.global_state))
        self.global_state.update(
            {name: torch.zeros_like(self.global_state[like]) for name, like in extras.items()}
        )
        self.manifest: Manifest = task.manifest(self.model).extended(extras)
        # every kept state tensor named like a global tensor has its shape (fedmq.state_checks)
        self.shapes = {name: tuple(t.shape) for name, t in self.global_state.items()}
        self.inbox.limits = Limits.for_model(self.manifest.message_bound)
        self.version = 0
        self.round = 1
        self.presence = Presence(cfg, self.inbox)  # who is online
        shared = cfg.identity.startswith("shared:")
        self.inbox.budget = PresenceBudget(cfg.presence_window_s, self.presence.allowance, shared)
        self.best: tuple[float, int] | None = None  # (score, round)
        self.lr_scale = 1.0  # the clients' lr × this: ÷ cfg.lr_anneal each time validation did not improve
        self.folded: dict[int, list[str]] = {}  # round -> msg ids of the updates folded into it (the audit)
        # what the job's strategy carries from round to round (Strategy.state_dict), by strategy name
        self.strategy_state: dict[str, dict[str, Any]] = {}
        # client -> version its last folded update trained from (kept models)
        self._trained_from: dict[str, int] = {}
        # client -> the newest version one of its updates in a published version trained from, within the
        # staleness window (asynchronous mode takes one update per client and version; checkpointed)
        self.folded_from: dict[str, int] = {}
        self.stream = ModelStream(cfg, broker, task.groups)  # the model's forms, each version's once
        self._status_written = 0.0
        # the inbox's active consumer: only it writes status.json (a standby shares the folder)
        self._active = False
        self.last_row: dict[str, Any] = {}
        self.budget_spent = False  # the target ε ended the job (within_budget)
        self.phase = "starting"
        self._consumer: str | None = None
        self._trimmer = Trimmer(RELEASE_EVERY, RELEASE_GROWTH)  # parkings and folds
        # checkpoints and best.pt are written while the next round runs (aggregator.checkpoint_writer)
        self.writer = CheckpointWriter()
        self._new_best: dict[str, torch.Tensor] | None = None  # a new best: best.pt, beside the checkpoint

    # ------------------------------------------------------------------ lifecycle
    @property
    def started(self) -> bool:
        """Subscribed to the inbox: start-up (the broker waits a signal must be able to cut short) is over."""
        return self._consumer is not None

    def run(self, resume: bool = True) -> dict[str, Any]:
        """Declare the topology, resume from the last checkpoint, run the rounds, write the summary."""
        self.declare()
        self._consumer = self.inbox.subscribe(
            topology.q_inbox(self.cfg.job), prefetch=self._inbox_prefetch(), reassembly=self._reassembly()
        )
        started = time.time()
        try:
            self.phase = "standby"
            log.info(
                "waiting for the first delivery "
                "(a hot standby waits here while another aggregator is active)",
                job=self.cfg.job,
            )
            if not self.inbox.wait_first(self.stop):
                return self._summary(time.time() - started)
            self._active = True
            self.phase = "starting"
            log.info("active consumer of the inbox", job=self.cfg.job)
            if resume:
                self._restore()
            self.runlog.write_config(self._config_record())
            if self.cfg.mode == "async":
                (SecureBuffers if self.cfg.secagg else AsyncRounds)(self).run()
            else:
                runner = TieredRound if self.cfg.edges else SecureRound if self.cfg.secagg else SyncRound
                while self.round <= self.cfg.rounds and not self.stop.is_set() and self.within_budget():
                    runner(self).run()
            self.writer.wait()
        finally:
            # a write still pending when the run failed: on disk before the inbox goes to a standby, which
            # resumes from that checkpoint and the spools it leaves
            self.writer.join()
            if self._active:  # a standby never writes to the state it shares (docs/reliability.md)
                self.spool.drop_free()
            if self._consumer:
                self.broker.cancel(self._consumer)
        summary = self._summary(time.time() - started)
        self.runlog.write_summary(summary)
        if self._all_rounds_done():
            self._end_job()
        else:
            self.phase = "stopped"
        return summary

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        self._write_status(force=True)

    def _write_status(self, force: bool = False) -> None:
        """Keep the run folder's status.json current (at most once a second unless the phase changed): what
        `fedmq status --run-dir` shows while the job is live."""
        now = time.time()
        if self._active and (force or now - self._status_written >= 1.0):
            self._status_written = now
            info = {k: v for k, v in self.status().items() if k != "last_metrics"}
            self.runlog.write_status({**info, "updated_at": now, "pid": os.getpid()})

    def _all_rounds_done(self) -> bool:
        done = self.version >= self.cfg.rounds if self.cfg.mode == "async" else self.round > self.cfg.rounds
        return (done or self.budget_spent) and not self.stop.is_set()

    def within_budget(self) -> bool:
        """Whether one more release keeps ε within the job's target ε (aggregator.privacy_ledger). When it
        would not, the job ends here, between rounds, as if its rounds were done: the last round's checkpoint
        holds the final model."""
        if self.privacy is None or self.privacy.within_budget():
            return True
        self.budget_spent = True
        return False

    def _end_job(self) -> None:
        """Tell every agent the job is over (one message to the control binding every agent's queue has): they
        leave instead of waiting for rounds that will never come. Only a job that ran all its rounds ends."""
        env = messages.end(self.cfg.job, self.version, len(self.folded))
        try:
            self.broker.publish(
                topology.rk_control(self.cfg.job), messages.encode(env), message_id=env.msg_id
            )
        except FedmqError as exc:  # the run is complete either way; agents then stay until stopped
            log.warning("could not tell the agents the job ended", error=str(exc))
        self.presence.clear()
        self.phase = "finished"
        log.info("job finished: agents told to leave", job=self.cfg.job, version=self.version)

    def declare(self) -> None:
        """Declare the job's exchange, inbox and model stream (idempotent;
        agents need the exchange to join)."""
        edges = tuple(range(self.cfg.edges))  # declared here too: agents may upload before an edge starts
        self.broker.declare_job(self.cfg.job, [], model_bytes=self.manifest.message_bound, edges=edges)

    def _inbox_prefetch(self) -> int:
        """Every chunk of every selected update may be in flight (aggregator.inbox.upload_prefetch); secure
        buffers also hold messages of each client unacked (HELD_A_CLIENT)."""
        cfg = self.cfg
        window = upload_prefetch(self.broker, self.manifest.message_bound, cfg.most_selected())
        held = HELD_A_CLIENT * cfg.clients if cfg.secagg and cfg.mode == "async" else 0
        return min(MAX_PREFETCH, window + held)

    def _reassembly(self) -> ReassemblyLimits:
        """Bounds on incomplete chunked updates, from the manifest (aggregator.inbox.upload_reassembly)."""
        uploaders = self.cfg.clients if self.cfg.mode == "async" else self.cfg.most_selected()
        return upload_reassembly(self.inbox.limits.max_message_bytes, uploaders)

    def status(self) -> dict[str, Any]:
        online = self.online()
        return {
            "job": self.cfg.job,
            "round": self.round,
            "version": self.version,
            "phase": self.phase,
            # the first names (a population's would be megabytes, rewritten every second)
            "agents_online": online[:ONLINE_NAMES],
            "agents_online_count": len(online),
            "last_metrics": self.last_row,
            "rejected": dict(self.inbox.rejected),
            "dropped": dict(self.inbox.dropped),
            # presence dropped over its sender's budget (aggregator.presence_budget), by sender
            "presence_over_budget": dict(self.inbox.budget.over) if self.inbox.budget else {},
            **(self.privacy.record() if self.privacy else {}),  # ε spent so far, under DP
        }

    # ------------------------------------------------------------------ presence (aggregator.presence)
    @property
    def hosted(self) -> dict[str, str]:
        """Client -> the host serving it (from the hosts' rosters)."""
        return self.presence.hosted

    def online(self) -> list[str]:
        return self.presence.online()

    def note_presence(self, msg: Received) -> list[str]:
        """Note an agent's or a host's presence; the clients it says went offline."""
        left = self.presence.note(msg)
        self._write_status()
        return left

    def wait_for_agents(
        self, needed: int, timeout: float, handle: Callable[[Received], None] | None = None
    ) -> None:
        """Handle presence (nothing else can arrive before an announce; ``handle``, when given, takes every
        message instead) until enough agents are online and every heartbeat queued when the wait began is
        counted. Draining matters: heartbeats that queued up
        while the aggregator was busy (evaluation, checkpoint) would otherwise look stale, and selection would
        sample from just the first ``needed`` agents read instead of from every live one. Only that backlog:
        with many agents heartbeats keep arriving, and waiting for an empty inbox could take the whole
        timeout."""
        deadline = time.time() + timeout
        backlog = self.inbox.mark()
        while time.time() < deadline and not self.stop.is_set():
            if len(self.online()) >= needed and self.inbox.drained(backlog):
                return
            msg = self.inbox.next(min(0.2, deadline - time.time()))
            if msg is not None:
                (handle or self._dispatch_idle)(msg)

    def _dispatch_idle(self, msg: Received) -> None:
        if msg.env.kind is Kind.PRESENCE:
            self.note_presence(msg)
        else:
            self.inbox.drop(msg, "no-open-round" if msg.env.round != self.round else "unexpected")

    # ------------------------------------------------------------------ publishing the model
    def announce(self, stats: RoundStats) -> None:
        """Publish the forms of the current version the selected agents need (once each:
        aggregator.model_stream), then the small announce to each selected agent (async: to every agent).
        bytes_down counts the announces and, for each selected agent, the form it will fetch (none when it
        already holds it)."""
        forms = self.stream.publish(self.version, self.global_state, [self._holds(c) for c in stats.selected])
        env = messages.announce(
            self.cfg.job,
            stats.round,
            self.version,
            stats.selected,
            self.cfg.round_config(stats.round, self.lr_scale),
            [entry for entry, _ in forms.values()],
            self.cfg.mode,
            client=self.client,
        )
        body = messages.encode(env)
        if self.cfg.mode == "sync":  # only the selected agents hear of the round: O(m) messages, not O(K)
            recipients = self.recipients(stats.selected)
            for to, clients in recipients.items():
                try:
                    self.broker.publish(topology.rk_announce(self.cfg.job, to), body, message_id=env.msg_id)
                except Undeliverable as exc:  # its queue is gone: the agent loses its place, not the job
                    for client in clients:
                        self.leave_out(stats, client, f"announce undeliverable: {exc}")
            stats.bytes_down += len(body) * len(recipients)
        else:  # asynchronous: every online agent trains on the newest version
            try:
                self.broker.publish(topology.rk_global(self.cfg.job), body, message_id=env.msg_id)
            except Undeliverable as exc:  # no agent queue bound: nobody hears of this version
                log.warning("announce undeliverable: no agent can hear of this version", error=str(exc))
            stats.bytes_down += len(body) * max(len(stats.online), len(stats.selected))
        for client in stats.selected:
            form = self._form_for(client, forms)
            if form is not None:
                stats.bytes_down += forms[form][0]["bytes"]
                stats.bytes_down_raw += forms[form][1]
        self.phase = "training"
        log.info(
            "round announced",
            round=stats.round,
            version=self.version,
            selected=len(stats.selected),
            forms=sorted(forms),
            bytes=len(body),
        )

    def recipients(self, clients: list[str]) -> dict[str, list[str]]:
        """Where messages for ``clients`` go: each one's own queues, or once to the host serving several."""
        out: dict[str, list[str]] = {}
        for client in clients:
            out.setdefault(self.hosted.get(client, client), []).append(client)
        return out

    def leave_out(self, stats: RoundStats, client: str, why: str) -> None:
        """``client`` cannot be delivered to (its queue deleted, by accident or on purpose): it loses its
        place in the round, named with the reason in the round's record; the round goes on without it."""
        log.warning("agent unreachable: left out of the round", round=stats.round, client=client, reason=why)
        stats.unreachable[client] = why
        stats.selected = [c for c in stats.selected if c != client]
        stats.granted = [c for c in stats.granted if c != client]

    def _holds(self, client: str) -> int:
        """The version ``client`` holds: what its presence says or, when the job has agents keep the model
        they trained from, the version of its last folded update if newer
        (its heartbeat may not have said so yet)."""
        return max(self.presence.holds(client), self._trained_from.get(client, messages.NO_VERSION))

    def _form_for(self, client: str, forms: Forms) -> str | None:
        """The form of the current version ``client`` will fetch, judged from the version we believe it
        holds (aggregator.model_stream)."""
        return ModelStream.form_for(self.version, self._holds(client), forms)

    # ------------------------------------------------------------------ folding (both modes)
    def took_update(self) -> None:
        """An update parked or folded (a parked one counts again when folded): every RELEASE_EVERY the heap's
        free pages go back once the process grew by RELEASE_GROWTH (broker.wire.malloc). Parking counts: a
        round whose first client in fold order is late parks hundreds, and the heap grows meanwhile (in a
        simulation, with its agents' work too)."""
        self._trimmer.took()

    def begin_strategy(self, stats: RoundStats, choice: str, **extra: Any) -> Strategy:
        """The round's strategy ``choice`` built from the job's settings and begun with the global model;
        ``extra`` from a first pass (second_pass)."""
        stats.strategy, strategy = strategy_from_config(choice, self.cfg, **extra)
        if isinstance(strategy, Private):
            strategy.draw_from(self.noise_seed, stats.round)
        strategy.load_state_dict(self.strategy_state.get(stats.strategy, {}))
        self.guard.begin()
        strategy.begin(self.global_state)
        return strategy

    def fold(
        self, stats: RoundStats, strategy: Strategy, arrival: Arrival, *, screen: bool = False
    ) -> ClientUpdate | None:
        """Decode an update against the manifest and the model it trained from and fold it: the one fold
        path of both modes. A bad update is rejected (when live) and None returned; the caller spools and
        acks a folded one. ``screen`` (asynchronous mode): the guard judges the update before it is folded
        (RoundGuard.screen)."""
        env, base = arrival.env, arrival.base
        self.took_update()
        try:
            update = self.decode_update(env, base, arrival.staleness)
        except CodecError as exc:
            reason, detail = exc.reason, str(exc)
        except Exception as exc:  # never let a hostile update crash the engine
            reason, detail = "undecodable", f"{type(exc).__name__}: {exc}"
        else:
            why = self.guard.screen(update, base) if screen else None
            try:
                if why is not None:
                    raise _OutOfBounds(why)
                strategy.fold(self.guard.capped_ahead(update))
            except _OutOfBounds as exc:
                log.warning("update out of bounds: rejected", client=env.client, reason=str(exc))
                reason, detail = "out-of-bounds", str(exc)
            except (
                FedmqError,
                ValueError,
                TypeError,
                RuntimeError,
            ) as exc:  # strategies validate before folding
                reason, detail = "rejected-by-strategy", str(exc)
                self.guard.withdraw(update)
            else:
                stats.received.append(env.client)
                stats.bytes_up += arrival.size
                stats.bytes_up_raw += raw_nbytes(update.tensors)
                return update
        self.inbox.refuse(arrival.received, arrival.parked, reason, detail)
        return None

    def fold_partial(self, stats: RoundStats, strategy: Strategy, arrival: Arrival, routed: set[str]) -> bool:
        """Fold an edge aggregator's partial sum (two-tier aggregation) of the clients ``routed`` to it: the
        partial counterpart of ``fold``, and like it the caller spools and acks one folded. Its clients join
        the round's record as if their updates had come here; a partial that names a client not routed to
        its edge, or does not fit the model, is rejected (when live) and False returned."""
        env, p = arrival.env, arrival.env.payload
        self.took_update()
        clients, failed, guard = set(p["clients"]), set(p["failed"]), p["guard"]
        judged = set(guard["dropped"]) | set(guard["capped"])
        try:
            if not clients | failed | judged <= routed or clients & failed:
                raise CodecError("bad-partial", f"edge {env.client} names clients not routed to it")
            part = decode_partial(env, self.manifest)
            if set(part.terms) != clients:
                raise CodecError("bad-partial", f"edge {env.client}: weights and clients differ")
            strategy.fold_partial(part)
        except CodecError as exc:
            reason, detail = exc.reason, str(exc)
        except (FedmqError, ValueError, TypeError, RuntimeError) as exc:
            reason, detail = "rejected-by-strategy", str(exc)
        except Exception as exc:  # never let a damaged partial crash the engine
            reason, detail = "undecodable", f"{type(exc).__name__}: {exc}"
        else:
            for client, (_, loss, _, update_id) in p["clients"].items():
                stats.received.append(client)
                stats.update_ids[client] = update_id
                stats.reported.setdefault(client, float(loss))
                self.note_trained_from(client, env.model_version)
            stats.failed.update(failed)
            for client, why in p["failed"].items():  # what the edge refused, counted here too
                self.inbox.count_rejection(why, f"edge {env.client}: {client}")
            stats.edge_verdict.dropped.update(guard["dropped"])
            stats.edge_verdict.capped.update(guard["capped"])
            stats.bytes_up += p["bytes"][0]
            stats.bytes_up_raw += p["bytes"][1]
            return True
        self.inbox.refuse(arrival.received, arrival.parked, reason, detail)
        return False

    def tell_edge(
        self, stats: RoundStats, edge: int, clients: list[str], deadline_s: float, first: bool = True
    ) -> None:
        """Send edge aggregator ``edge`` the round's clients routed to it, the time it waits for them and
        where the exact model they trained from is (edge-round); bytes_down counts the model it reads
        (``first``: the first time in the round)."""
        entry = self.stream.exact(self.version, self.global_state)
        env = messages.edge_round(
            self.cfg.job, stats.round, self.version, clients, deadline_s, stats.strategy, entry
        )
        body = messages.encode(env)
        try:
            self.broker.publish(topology.rk_edge(self.cfg.job, edge), body, message_id=env.msg_id)
        except Undeliverable as exc:  # its queue deleted: its clients' updates are lost for this round
            log.warning("edge unreachable: its clients' round is lost", edge=edge, error=str(exc))
        stats.bytes_down += len(body) + (entry["bytes"] if first else 0)

    def decode_update(
        self, env: Envelope, base: State, staleness: int = 0, n_samples: int | None = None
    ) -> ClientUpdate:
        """``env``'s update as a delta from ``base`` (checked against the manifest); ``n_samples`` replaces
        its claim (a weight the guard capped)."""
        return decode_update(env, self.manifest, base, staleness, n_samples)

    def note_trained_from(self, client: str, version: int) -> None:
        """Where agents keep the model they trained from, ``client`` now holds ``version`` (see _holds)."""
        if self.cfg.keep_model:
            self._trained_from[client] = version

    def _note_folded_from(self, trained_from: dict[str, int]) -> None:
        """A published asynchronous round's (client, version) pairs, kept while an update from that version
        could still arrive (a skipped round keeps none: its clients' next updates from it are welcome)."""
        for client, version in trained_from.items():
            self.folded_from[client] = max(version, self.folded_from.get(client, messages.NO_VERSION))
        oldest = self.version - self.max_staleness  # older ones are too stale to train from anyway
        self.folded_from = {c: v for c, v in self.folded_from.items() if v >= oldest}

    def folded_ids(self) -> set[str]:
        """Message ids of every update folded so far (the audit: aggregator.checkpoint keeps them)."""
        return {uid for ids in self.folded.values() for uid in ids}

    # ------------------------------------------------------------------ closing a round
    def close_round(self, stats: RoundStats, strategy: Strategy | None, skipped: str | None = None) -> None:
        cfg = self.cfg
        if skipped is None and (strategy is None or len(stats.received) < cfg.min_clients):
            skipped = f"{len(stats.received)} update(s) < min {cfg.min_clients}"
        weights: dict[str, float] = {}
        verdict = Verdict()
        state: dict[str, Any] = {}
        if skipped is None:
            new, weights, verdict, skipped, state = self._finish_guarded(stats, strategy)
            verdict.dropped.update(stats.edge_verdict.dropped)  # judged on the edges (aggregator.edge)
            verdict.capped.update(stats.edge_verdict.capped)
        if skipped is None:
            if state:
                self.strategy_state[stats.strategy] = state
            self.stream.keep_previous(self.global_state)
            self.global_state = new
            self.version += 1
            self.folded[stats.round] = sorted(
                v for c, v in stats.update_ids.items() if c not in verdict.dropped
            )
            self._note_folded_from(stats.trained_from)
        else:
            log.warning("round skipped", round=stats.round, reason=skipped)
        if self.privacy is not None and (skipped is None or cfg.mode == "sync"):
            # a synchronous round is a release whether or not it closes (conservative: a skip says only that
            # too few came); an asynchronous version is one when published
            self.privacy.release()
        score = self._evaluate(stats.round) if skipped is None else None
        record = self._record(stats, score, weights, skipped, verdict)
        self.round += 1
        # row first: a kill before the checkpoint is on disk redoes the round, and the resume truncates this
        # row again; the checkpoint (and best.pt) are written while the next round runs, and the round's spool
        # is cleared only then (aggregator.checkpoint_writer). The previous round's checkpoint is on disk
        # before this row is written: the rows never run more than one round past the newest checkpoint
        self.writer.wait()
        self.runlog.append(record)
        self.writer.submit(self._checkpoint_write(stats.round))
        if cfg.mode == "async" or cfg.secagg or (self.privacy is not None and self.noise_seed is None):
            # on disk before the next round. Asynchronous mode resumes only its open buffer's spool. Secret
            # noise: a round folded again would not give the model the next round publishes, and two noised
            # versions of one round would be two releases the accountant counts once. A secure round cannot
            # be folded again at all (aggregator.secure_round)
            self.writer.wait()
        self.last_row = row = record.to_json()
        if self.on_round:
            self.on_round(row)
        log.info(
            "round closed",
            round=stats.round,
            strategy=stats.strategy,
            received=len(stats.received),
            score=score,
            skipped=skipped,
        )

    def _finish_guarded(
        self, stats: RoundStats, strategy: Strategy
    ) -> tuple[dict[str, torch.Tensor], dict[str, float], Verdict, str | None, dict[str, Any]]:
        """The round's aggregate within the bounds of aggregator.guards: (state, weights, verdict,
        skip reason).

        When an update is out of bounds the round is folded again from its spool without it (or with its
        weight capped); a round whose aggregate or strategy state fails fedmq.state_checks (a NaN/Inf, an
        overflowing norm, a wrong shape) is never kept: it is skipped, model and strategy state unchanged."""
        verdict = self.guard.verdict()
        second = strategy.second_pass(frozenset(verdict.dropped))  # weights that need the whole round first
        in_order = in_fold_order(stats.received, stats.granted)  # the second pass folds in the grant's
        again = self.guard.refold_needed(verdict, in_order)  # not when its caps were applied as folded
        if again and verdict:
            log.warning(
                "updates out of bounds: the round is aggregated again without them",
                round=stats.round,
                dropped=verdict.dropped,
                capped=verdict.capped,
            )
        elif again:
            log.info(
                "weights capped as folded, not as the round closed: it is aggregated again", round=stats.round
            )
        elif verdict:
            log.info("weights capped as folded", round=stats.round, capped=verdict.capped)
        if again or second is not None:
            strategy = self._refold(stats, verdict, second or {})
        new = {k: v.float() for k, v in strategy.finish().items()}
        weights = strategy.client_weights()
        if self.guard.screened:  # asynchronous: judged before folding, nothing to fold again
            verdict = self.guard.screened
        bad = first_nonfinite(new)
        state = strategy.state_dict()
        if bad is not None:
            what = f"aggregate not finite (tensor {bad!r})"
        elif (why := state_problem(new, self.shapes)) is not None:
            what = f"aggregate out of bounds ({why})"
        elif (why := strategy.check_state(state, self.global_state)) is not None:
            what = f"strategy state out of bounds ({why})"
        else:
            return new, weights, verdict, None, state
        clients = sorted(set(stats.received) - set(verdict.dropped))
        reason = f"{what}: round closed without the updates of {', '.join(clients)}"
        log.warning("round state not kept", round=stats.round, reason=what, clients=clients)
        return {}, {}, verdict, reason, {}

    def _refold(self, stats: RoundStats, verdict: Verdict, params: dict[str, Any]) -> Strategy:
        """Fold the round's spooled updates again (the same strategy, in the fold order of _fold_in_order),
        leaving out the dropped ones and capping n_samples; they were all folded once,
        so they decode again."""
        state, _ = self.spool.load(stats.round)
        strategy = self.begin_strategy(stats, (state or {}).get("strategy") or self.cfg.strategy, **params)
        folded = set(stats.received)
        for client in stats.granted:
            body = self.spool.read_update(stats.round, client) if client in folded else None
            if body is None or client in verdict.dropped:
                continue
            env = messages.decode(body)
            n = min(env.payload["n_samples"], verdict.capped.get(client, env.payload["n_samples"]))
            strategy.fold(self.decode_update(env, self.global_state, n_samples=n))
        return strategy

    def _evaluate(self, rnd: int) -> float | None:
        if not self.evaluate or rnd % self.cfg.eval_every:
            return None
        self.phase = "evaluating"
        score = self._score(self.global_state, "valid")
        better = self.best is None or (
            score > self.best[0] if self.task.higher_is_better else score < self.best[0]
        )
        if not better and self.cfg.lr_anneal > 1:
            # the classic word-language-model schedule: the clients' lr ÷ lr_anneal when validation stalls
            self.lr_scale /= self.cfg.lr_anneal
            log.info("validation did not improve: clients' lr annealed", round=rnd, lr_scale=self.lr_scale)
        if better and math.isfinite(score):
            self.best = (score, rnd)
            self._new_best = {k: v for k, v in self.global_state.items() if k in self.model_names}
        return score

    def _score(self, state: State, split: str) -> float:
        """The task's metric of ``state`` on ``split``, computed on the run's device (a GPU run's full-split
        perplexity on the CPU would cost more than the round)."""
        load_state(self.model, {k: v for k, v in state.items() if k in self.model_names})
        self.model.to(self.eval_device)
        try:
            return float(self.task.evaluate(self.model, split))
        finally:
            self.model.to("cpu")

    def _record(
        self,
        stats: RoundStats,
        score: float | None,
        weights: dict[str, float],
        skipped: str | None,
        verdict: Verdict,
    ) -> RoundRecord:
        losses = list(stats.reported.values())
        reported, privacy = stats.reported, {}
        if self.privacy is not None:  # under DP no client's own loss or weight is recorded: ε and δ instead
            losses, reported, privacy = [], {}, self.privacy.record()
        return RoundRecord(
            round=stats.round,
            time=time.time(),
            version=self.version,
            strategy=stats.strategy or None,
            metric=self.task.metric,
            valid=score,
            mean_loss=math.fsum(losses) / len(losses) if losses else None,
            online=tuple(stats.online) if len(stats.online) <= ONLINE_NAMES else (),
            online_count=len(stats.online),
            selected=tuple(stats.selected),
            reported=tuple(sorted(reported)),
            losses=dict(sorted(reported.items())),
            granted=tuple(stats.granted),
            received=tuple(sorted(stats.received)),
            update_ids=dict(sorted(stats.update_ids.items())),
            dropped=() if self.cfg.mode == "async" else tuple(stats.dropped()),  # async expects no one
            skipped=skipped is not None,
            skip_reason=skipped,
            bytes_up=stats.bytes_up,
            bytes_down=stats.bytes_down,
            bytes_up_raw=stats.bytes_up_raw,
            bytes_down_raw=stats.bytes_down_raw,
            wall_s=time.time() - stats.started,
            cpu_s=secret_pool.cpu_time() - stats.cpu_started,
            weights=weights,
            rejected=dict(self.inbox.rejected),
            dropped_msgs=dict(self.inbox.dropped),
            guard=verdict.record() if verdict else None,
            unreachable=dict(sorted(stats.unreachable.items())) or None,
            **privacy,
        )

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_write(self, closed: int) -> Callable[[], None]:
        """The checkpoint of the job as it stands (round ``closed`` closed), captured now; what writes it, and
        the new best model before it, then clears the closed round's spool."""
        prepared = prepare_checkpoint(
            self.ckpt_dir,
            round=self.round,
            model_version=self.version,
            global_state=self.global_state,
            strategy_state=self.strategy_state,
            mediator_state=self.mediator.state_dict(),
            rng_state=None,
            folded=self.folded,
            extra={
                "best": self.best,
                "presence_versions": {},
                "guard": self.guard.state_dict(),
                "lr_scale": self.lr_scale,
                "folded_from": self.folded_from,
                **(self.privacy.state_dict() if self.privacy else {}),
            },
            keep=self.cfg.keep_checkpoints,
        )
        best, self._new_best = self._new_best, None

        def write() -> None:
            if best is not None:
                with replacing(self.run_dir / "best.pt", private=True) as fh:
                    torch.save(best, fh)
            prepared.write()
            self.spool.clear_upto(closed)

        return write

    def _restore(self) -> None:
        ckpt = load_checkpoint(self.ckpt_dir)
        if ckpt is None:
            check_fresh_start(self.ckpt_dir, max((r.round for r in self.runlog.rows()), default=0))
            self.runlog.truncate_after(0)  # round 1's row, written before a kill: round 1 runs again
            return
        check_resumable(ckpt, self.shapes, lambda name: strategy_from_config(name, self.cfg)[1])
        self.round, self.version = ckpt.round, ckpt.model_version
        self.global_state = {k: v.float() for k, v in ckpt.global_state.items()}
        self.mediator.load_state_dict(ckpt.mediator_state)
        self.strategy_state = dict(ckpt.strategy_state or {})
        self.folded = {int(k): v for k, v in ckpt.folded.items()}
        best = ckpt.extra.get("best")
        self.best = tuple(best) if best else None
        self.lr_scale = float(ckpt.extra.get("lr_scale", 1.0))
        self.folded_from = {str(c): int(v) for c, v in (ckpt.extra.get("folded_from") or {}).items()}
        self.guard.load_state_dict(ckpt.extra.get("guard"))
        PrivacyLedger.restore(self.privacy, ckpt.extra)
        self.runlog.truncate_after(self.round - 1)
        log.info("resumed from checkpoint", round=self.round, version=self.version)

    # ------------------------------------------------------------------ summary
    def _config_record(self) -> dict[str, Any]:
        return {
            **self.cfg.to_dict(),
            **self.task.describe(),
            "manifest_tensors": len(self.manifest),
            "parameters": self.manifest.numel,
        }

    def _summary(self, wall: float) -> dict[str, Any]:
        rows = self.runlog.rows()
        test = None
        best_path = self.run_dir / "best.pt"
        if self.evaluate and best_path.is_file() and not self.stop.is_set():
            self.phase = "testing"
            test = self._score(torch.load(best_path, weights_only=True), "test")
        return {
            "metric": self.task.metric,
            "higher_is_better": self.task.higher_is_better,
            "best_round": self.best[1] if self.best else None,
            "best_valid": self.best[0] if self.best else None,
            "test": test,
            "rounds_completed": sum(1 for r in rows if not r.skipped),
            "rounds_skipped": sum(1 for r in rows if r.skipped),
            "wall_s": wall,
            # this process's CPU seconds and its secret workers': the aggregator's own as a service (with its
            # agents under simulate)
            "cpu_s": secret_pool.cpu_time(),
            "strategy": self.cfg.strategy,
            "version": self.version,
            "bytes_up": sum(r.bytes_up or 0 for r in rows),
            "bytes_down": sum(r.bytes_down or 0 for r in rows),
            "rejected": dict(self.inbox.rejected),
            "dropped": dict(self.inbox.dropped),
            # the influence guard (aggregator.guards): rounds it acted in, updates capped and left out
            "guard": guard_summary(rows),
            "interrupted": self.stop.is_set(),
            # a run that ended by itself with no round done failed, in one line (None: it did not)
            "no_round_completed": None
            if self.stop.is_set()
            else no_round_completed(rows, self.inbox.rejected),
            "inbox_left": self.inbox.left(),
            **(self.privacy.summary(self.budget_spent) if self.privacy else {}),
        }
