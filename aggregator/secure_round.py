"""One synchronous round under secure aggregation (`secagg = true`, docs/guide/secure-aggregation.md): the
aggregator learns the sum of the survivors' quantized updates and nothing else about any one of them.

It selects and announces as a synchronous round (aggregator.sync_round), then drives SecAgg+
(fedmq.secagg.masking.MaskingServer) over the job's queues, one step at a time, each until every client
expected has answered, has gone offline, or the step's deadline has passed (the clients' side:
client_agent.secure_upload; the messages: fedmq.secagg.payloads):

1. keys: the selected clients' public keys (they send them on the announcement) until the report deadline;
   the cohort is who sent them. The aggregator plans the graph (k, t: fedmq.secagg.graph.plan) and the bits a
   coordinate (b: the most whose sum over the cohort cannot wrap) and sends the cohort;
2. shares: each member's encrypted shares, once it has trained and reported (until the report deadline, or
   update_deadline_s after the cohort went out if that is later); each member then gets its inbox, and n_max
   (the largest n_k reported, capped at max_samples_factor × their lower median, the sample guard's rule for a
   round with no history; 0 when the strategy weighs clients equally);
3. masked: the masked vectors of the members that shared, added to the running sum as they come (acked once
   added: nothing of them is kept but that sum) until update_deadline_s;
4. unmask: the survivors' shares of the seeds and keys the sum needs, until update_deadline_s; then the sum
   is unmasked, decoded into Σ w_k Δ_k / Σ w_k and folded into the round's strategy as one partial sum
   (Strategy.fold_partial), so the server optimizers take their step on the unmasked mean.

A message a step refuses (a public key that cannot be agreed with, shares for the wrong neighbours, a vector
of the wrong length) is counted by name and acked (a dead-letter queue would keep what it carries), and its
sender counted as dropped; a round the protocol cannot complete (fewer members than it needs,
fewer survivors than t, shares that rebuild no secret, a sum out of range) is skipped in one line, with the
model and the strategy state as they were.

Crash safety: nothing of one client's input, masked or not, is written; the spool holds the round's
selection and reports only. A secure round that a restart finds open cannot be finished (the shares and
the running sum were in the old aggregator's memory), so it is closed as skipped, with a grant of nobody to
its clients (one still waiting for the old aggregator's next step stops), and the job goes on with the
next round; the engine writes a secure round's checkpoint before it announces the next one, so that a
version is never published twice with different models.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import structlog
import torch

from fedmq.aggregator import secret_pool
from fedmq.aggregator.inbox import Received
from fedmq.aggregator.rounds import RoundContext
from fedmq.aggregator.strategies.base import PartialSum, State, Strategy
from fedmq.aggregator.sync_round import SyncRound
from fedmq.broker.transport import topology
from fedmq.broker.transport.errors import Undeliverable
from fedmq.broker.wire import messages
from fedmq.broker.wire.envelope import Kind
from fedmq.errors import FedmqError, SecAggError
from fedmq.secagg import graph, keys, payloads
from fedmq.secagg.keys import PublicKeys
from fedmq.secagg.masking import MaskingServer
from fedmq.secagg.payloads import context
from fedmq.secagg.quantize import Quantizer, max_bits

log = structlog.get_logger(__name__)

INTERRUPTED = "secure round interrupted by a restart: its shares and masked sum were never written"


def unflatten(vector: np.ndarray, like: State) -> dict[str, torch.Tensor]:
    """A flat vector back into tensors shaped as ``like``'s, in the order of their names (the clients'
    order: client_agent.secure_upload.flat_change; neither side imports the other)."""
    out, at = {}, 0
    for name in sorted(like):
        size = like[name].numel()
        out[name] = torch.from_numpy(vector[at : at + size].reshape(tuple(like[name].shape)))
        at += size
    return out


def coordinates(like: State) -> int:
    """The length of a flat update of the model ``like``."""
    return sum(t.numel() for t in like.values())


def checked_keys(msg: Received) -> PublicKeys:
    """The public keys ``msg`` advertises; SecAggError for one that cannot be agreed with."""
    advertised = payloads.public_keys(msg.env.payload)
    keys.check_public(advertised.channel, msg.env.client)
    keys.check_public(advertised.mask, msg.env.client)
    return advertised


class SecureRound(SyncRound):
    """The engine's open round under secure aggregation (module docstring)."""

    def __init__(self, ctx: RoundContext) -> None:
        super().__init__(ctx)
        self.refused: set[str] = set()  # clients a step refused a message of: dropped from the protocol

    def run(self) -> None:
        ctx, stats = self.ctx, self.stats
        spooled, _ = ctx.spool.load(stats.round)
        if spooled is not None:  # open when the aggregator stopped: it cannot be finished (module docstring)
            stats.online, stats.selected = spooled["online"], spooled["selected"]
            stats.reported = spooled["reported"]
            ctx.hosted.update(spooled.get("hosts") or {})
            self._restored(spooled)
            self._release(restart=True)  # a client still waiting for the old aggregator's step stops
            ctx.close_round(stats, None, skipped=INTERRUPTED)
            return
        self._select()
        if not stats.selected:
            self._close_empty()
            return
        strategy, skipped = None, None
        try:
            strategy = self._secure_sum()
        except SecAggError as exc:
            skipped = str(exc)  # "secure aggregation: <reason>: <what>"
        finally:
            self._release()
        if ctx.stop.is_set():  # interrupted: a --resume closes it as skipped
            return
        self.closed = True
        self._save()
        ctx.close_round(stats, strategy, skipped)

    # ------------------------------------------------------------------ the protocol's steps
    def _secure_sum(self) -> Strategy | None:
        """Steps 1–4; the round's strategy with the unmasked mean folded in, or None (stopped, or too few
        members for the job's min_clients). SecAggError when the protocol cannot complete."""
        ctx, cfg, stats = self.ctx, self.cfg, self.stats
        report_by = time.time() + cfg.report_deadline_s
        strategy = ctx.begin_strategy(stats, cfg.strategy)
        roster = self._gather_keys(report_by)
        if ctx.stop.is_set():
            return None
        n, needed = len(roster), max(graph.MIN_COHORT, cfg.min_clients)
        if n < needed:
            raise SecAggError("too-few-members", f"{n} client(s) advertised keys, {needed} needed")
        params = graph.plan(n, cfg.secagg_corrupt, cfg.secagg_dropout)
        cohort = graph.Cohort.build(sorted(roster), params, os.urandom(graph.SEED_BYTES))
        quantizer = Quantizer(cfg.secagg_clip, max_bits(n), n)
        label = context(cfg.job, stats.round, ctx.version)
        server = MaskingServer(cohort, roster, label, coordinates(ctx.global_state) + 1)
        members = list(cohort.members)
        floor = max(params.threshold, cfg.min_clients)  # the fewest survivors whose sum may be unmasked
        log.info(
            "secure cohort", round=stats.round, members=n, degree=params.degree, threshold=params.threshold
        )
        self._formed(members)
        secret_pool.warm()  # its workers start while the cohort trains
        self._send(
            Kind.SECAGG_COHORT,
            self._cohort_audience(members),
            lambda _: payloads.cohort_payload(cohort, roster, quantizer.bits, label, floor),
        )

        shares_by = max(report_by, time.time() + cfg.update_deadline_s)
        take_shares = self._taker(server.receive_shares, payloads.shared_keys)
        shared = self._step("shares", Kind.SECAGG_SHARES, members, shares_by, take_shares)
        if ctx.stop.is_set():
            return None
        sharers = sorted(shared)
        max_samples = self._max_samples(sharers) if strategy.weighs_samples else 0
        stats.granted = sharers
        self._send(
            Kind.SECAGG_INBOX,
            members,  # a member that did not share learns that it is out
            lambda clients: {
                "inboxes": {c: server.inbox(c) for c in clients if c in shared},
                "max_samples": max_samples,
            },
        )

        def take_masked(msg: Received) -> None:
            server.receive_masked(msg.env.client, payloads.masked(msg.env.payload))
            stats.update_ids[msg.env.client] = msg.env.msg_id
            stats.bytes_up_raw += 4 * (server.length - 1)  # the update it carries, as raw fp32
            ctx.took_update()

        masked = self._step("masked", Kind.MASKED, sharers, time.time() + cfg.update_deadline_s, take_masked)
        if ctx.stop.is_set():
            return None
        if len(masked) < floor:  # a smaller sum would tell more of each input than the job allows
            raise SecAggError(
                "too-few-survivors", f"{len(masked)} of {n} clients sent masked inputs, {floor} needed"
            )
        request = server.unmask_request()
        survivors = list(request.survivors)
        # to every client that shared: one counted as dropped learns that it is out
        self._send(Kind.SECAGG_UNMASK, sharers, lambda _: payloads.unmask_payload(request))
        take_answer = self._taker(server.receive_unmask, payloads.unmask_shares)
        self._step("unmask", Kind.SECAGG_ANSWER, survivors, time.time() + cfg.update_deadline_s, take_answer)
        if ctx.stop.is_set():
            return None
        total = server.aggregate(secret_pool.combine)
        for fault in server.faults:  # the secret was rebuilt without it: counted and named as a rejection
            ctx.inbox.count_rejection("bad-share", fault)
        mean, weight = quantizer.decode_weighted_mean(total, len(survivors))
        self._fold(strategy, mean, weight * (max_samples or 1), survivors)
        return strategy

    # ------------------------------------------------------------------ what a secure buffer does otherwise
    def _gather_keys(self, report_by: float) -> dict[str, PublicKeys]:
        """Step 1: the selected clients' public keys, each checked on arrival, until ``report_by``."""
        roster: dict[str, PublicKeys] = {}

        def take_keys(msg: Received) -> None:
            roster[msg.env.client] = checked_keys(msg)

        self._step("keys", Kind.SECAGG_KEYS, self.stats.selected, report_by, take_keys)
        return roster

    def _formed(self, members: list[str]) -> None:
        """The cohort is ``members``, planned; its message goes out next."""

    def _cohort_audience(self, members: list[str]) -> list[str]:
        """Who hears of the cohort: every selected client (one whose keys came too late learns it is out)."""
        return self.stats.selected

    def _trained_from(self, client: str) -> int:
        """The version ``client``'s change was trained from."""
        return self.ctx.version

    def _release(self, restart: bool = False) -> None:
        """A grant of nobody: a client still waiting for a step of this round stops waiting (``restart``:
        the round was open when the aggregator stopped, and is closed without going on)."""
        self._send(Kind.GRANT, self.stats.selected, lambda _: {"granted": []})

    def _restored(self, spooled: dict[str, Any]) -> None:
        """What else a restart reads of the open round's spooled state, before it is closed."""

    def _max_samples(self, clients: Collection[str]) -> int:
        """n_max: the largest n_k of ``clients`` reported, capped at max_samples_factor × their lower median
        (the sample guard's rule for a round with no history: a secure round judges its own cohort)."""
        known = sorted(self.samples[c] for c in clients if c in self.samples) or [1]
        top = known[-1]
        if self.cfg.max_samples_factor > 0:
            top = min(top, max(1, int(self.cfg.max_samples_factor * known[(len(known) - 1) // 2])))
        return top

    def _fold(self, strategy: Strategy, mean: np.ndarray, weight: float, survivors: list[str]) -> None:
        """The unmasked mean as one partial sum of the survivors, folded into the round's strategy."""
        ctx, stats = self.ctx, self.stats
        g = ctx.global_state
        sums = {k: t * weight for k, t in unflatten(mean, g).items()}  # float64: the strategy's sums cast it
        share = weight / len(survivors)  # what the server knows of one client's weight: the mean
        part = PartialSum(sums, {k: (weight, weight) for k in sums}, weight, {c: share for c in survivors})
        try:
            strategy.fold_partial(part)
        except (FedmqError, ValueError, RuntimeError) as exc:
            raise SecAggError("bad-sum", f"the unmasked mean does not fit the model: {exc}") from None
        stats.received = list(survivors)
        for client in survivors:
            ctx.note_trained_from(client, self._trained_from(client))

    # ------------------------------------------------------------------ messages
    @staticmethod
    def _taker(
        receive: Callable[[str, Any], None], convert: Callable[[Any], Any]
    ) -> Callable[[Received], None]:
        """A step's ``take``: the sender's payload, converted, handed to the MaskingServer."""

        def take(msg: Received) -> None:
            receive(msg.env.client, convert(msg.env.payload))

        return take

    def _step(
        self,
        name: str,
        kind: Kind,
        expected: Collection[str],
        deadline: float,
        take: Callable[[Received], None],
    ) -> set[str]:
        """Take ``kind`` messages from the clients ``expected`` until each has sent one, has gone offline or
        was refused, or ``deadline`` passes; the clients taken. A message ``take`` refuses (SecAggError) is
        counted by name and acked, and its sender is out of the protocol."""
        ctx = self.ctx
        ctx.phase = f"secure-{name}"
        expected = set(expected) - self.refused
        done: set[str] = set()
        while not (
            ctx.stop.is_set() or done | self.gone | self.refused >= expected or time.time() >= deadline
        ):
            msg = ctx.inbox.next(min(0.5, max(deadline - time.time(), 0.0)))
            if msg is None:
                continue
            env = msg.env
            if self._screen(msg):
                continue
            if env.kind is not kind or env.client not in expected or env.client in self.refused:
                ctx.inbox.drop(msg, f"not-in-step-{name}")
            elif env.client in done:
                ctx.inbox.drop(msg, "duplicate")
            else:
                try:
                    take(msg)
                except SecAggError as exc:  # the sender is out of the protocol; the round goes on
                    # counted and acked, not rejected: a dead-letter queue would keep what it carries
                    ctx.inbox.count_rejection(exc.reason, f"{env.client}: {exc}")
                    ctx.inbox.ack(msg)
                    self.refused.add(env.client)
                    continue
                done.add(env.client)
                self.stats.bytes_up += msg.size  # every step's messages: the protocol's cost on the wire
                ctx.inbox.ack(msg)
        return done

    def _send(self, kind: Kind, clients: list[str], payload: Callable[[list[str]], dict[str, Any]]) -> None:
        """One message of ``kind`` to each recipient (agent or host) of ``clients``, its payload for the
        clients it serves; one that cannot be delivered loses its clients' place in the round."""
        ctx, stats = self.ctx, self.stats
        for to, served in ctx.recipients(clients).items():
            env = messages.secagg(kind, self.cfg.job, stats.round, "aggregator", ctx.version, payload(served))
            body = messages.encode(env)
            try:
                ctx.broker.publish(topology.rk_grant(self.cfg.job, to), body, message_id=env.msg_id)
            except Undeliverable as exc:
                for client in served:
                    ctx.leave_out(stats, client, f"{kind.value} undeliverable: {exc}")
                    self.gone.add(client)
            stats.bytes_down += len(body)
