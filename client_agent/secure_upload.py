"""A client's side of secure aggregation in one synchronous round (docs/guide/secure-aggregation.md): it
sends its masked update instead of its update, and the aggregator learns only the sum of the survivors'.

The steps, each answering the aggregator's (aggregator.secure_round; payloads: fedmq.secagg.payloads):

1. on the announcement, before training: advertise two fresh public keys (secagg-keys), so that the cohort
   forms while the clients train;
2. after training and the report: on the cohort (secagg-cohort), share its secrets with its neighbours
   (secagg-shares, each share encrypted to its holder);
3. on its inbox (secagg-inbox: its neighbours' shares, and n_max): clip the change it trained to [-c, c],
   weigh it by w = min(n_k, n_max) / n_max (1 where the strategy weighs clients equally), quantize it and w
   to b bits, mask it and upload it on its update key (masked);
4. on the unmasking request (secagg-unmask): send the shares it holds that the aggregator may have
   (secagg-answer).

In an asynchronous job (a secure buffer: aggregator.secure_buffers) the client checks in instead of step 1:
after training and its report it advertises its keys, tagged with the version it trained from, and waits for
a buffer's cohort that names it with the keys it just advertised (or a grant that refuses that check-in: too
stale, or replaced by the client's newer one), reading newer announcements on the way (a host's client is
parked meanwhile, and trains from the next version: Host._park). The cohort's round and version name the sum;
the client weighs its change by the staleness weight s(τ) of τ = the buffer's version − its own
(fedmq.staleness) as well as by n_k; the steps after that are the synchronous round's.

A step of another round is ignored; a newer announcement ends this round for the client, as one that does not
grant it. Anything the core refuses (a roster without its keys, a neighbour's share that does not decrypt, a
request that would unmask one client) is logged with what it names, and the client sits the rest of the round
out: the aggregator then counts it as dropped and rebuilds what it needs from the other clients' shares.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np
import structlog
import torch

from fedmq.broker.transport import topology
from fedmq.broker.wire import messages
from fedmq.broker.wire.envelope import Envelope, Kind
from fedmq.broker.wire.malloc import Trimmer
from fedmq.errors import SecAggError
from fedmq.hooks import stable_seed
from fedmq.privacy.client_dp import ClientDP
from fedmq.secagg import payloads
from fedmq.secagg.masking import MaskingClient
from fedmq.secagg.payloads import context
from fedmq.secagg.quantize import Quantizer
from fedmq.staleness import staleness_weight
from fedmq.tasks.base import TrainResult

log = structlog.get_logger(__name__)

# one client of this process quantizes, masks and uploads at a time: that step takes its codes (masked in
# place; under client DP also a stale change's weighed copy and its noise), and the packed message takes one
# more model-sized buffer; a host's clients all get their inbox at once
MASKING = threading.Lock()
# a client frees model-sized buffers twice (its trained model once its change is taken, its masked upload once
# sent): the process's free pages go back to the OS every TRIM_EVERY of those (broker.wire.malloc), so that a
# host's heap stays bounded without refilling it for every client
TRIM_EVERY = 4
FREED = Trimmer(TRIM_EVERY)


class Link(Protocol):
    """What a secure upload asks of its agent (client_agent.agent.Agent)."""

    client: str
    job: str

    def _wait_for(self, kind: Kind, rnd: int) -> Envelope | None: ...

    def _wait_for_cohort(self, since: int, check_in: str) -> Envelope | None: ...

    def _checked_in(self, version: int) -> None: ...

    def _send(self, env: Envelope, routing_key: str) -> None: ...

    def _upload_masked(self, rnd: int, version: int, result: TrainResult, env: Envelope) -> None: ...

    def _note_fault(self, rnd: int, what: str) -> None: ...


def flat_change(upload: Mapping[str, torch.Tensor], held: Mapping[str, torch.Tensor]) -> np.ndarray:
    """The update as one float32 vector: upload − held, tensor by tensor in the order of their names (the
    aggregator reads the sum back in the same order: aggregator.secure_round.unflatten)."""
    names = sorted(held)
    out = np.empty(sum(held[k].numel() for k in names), np.float32)
    at = 0
    for k in names:  # each difference written into its place: no per-tensor copies to concatenate
        n = held[k].numel()
        torch.sub(
            upload[k].float().reshape(-1), held[k].float().reshape(-1), out=torch.from_numpy(out[at : at + n])
        )
        at += n
    return out


class SecureUpload:
    """One client's secure aggregation in round ``rnd`` (module docstring)."""

    def __init__(
        self, agent: Link, rnd: int, version: int, clip: float, seed: int, asynchronous: bool = False
    ) -> None:
        self.agent, self.rnd, self.version, self.clip = agent, rnd, version, clip
        self.seed = seed  # the job's: the stochastic rounding repeats in a seeded run
        self.asynchronous = asynchronous  # a secure buffer: the client checks in after training
        self.masking = MaskingClient(agent.client, context(agent.job, rnd, version))
        self.dp: ClientDP | None = None  # client-mode DP: a stale change keeps a whole share (ClientDP.weigh)

    def advertise(self) -> None:
        """Step 1 (or an asynchronous buffer's check-in): c_u^PK and s_u^PK."""
        self.keys = self.masking.advertise()
        env = self._message(Kind.SECAGG_KEYS, payloads.keys_payload(self.keys))
        self.check_in = env.msg_id  # what a refusal of this check-in names
        self._publish(env)

    def _join_cohort(self) -> tuple[Envelope | None, float]:
        """The cohort message that names this client, and the staleness weight its change takes (1 in a
        synchronous round); (None, 0) when the round or buffer went on without it."""
        agent = self.agent
        if not self.asynchronous:
            env = agent._wait_for(Kind.SECAGG_COHORT, self.rnd)
            return (env, 1.0) if env is not None and agent.client in env.payload["members"] else (None, 0.0)
        self.advertise()  # the check-in, tagged with the version trained from
        agent._checked_in(self.version)
        while True:
            env = agent._wait_for_cohort(self.rnd, self.check_in)
            if env is None:
                return None, 0.0
            if payloads.cohort(env.payload)[1].get(agent.client) == self.keys:
                break  # (a cohort formed from an older check-in of ours is not ours to answer)
        tau = env.model_version - self.version
        if tau < 0:
            raise SecAggError("bad-version", f"buffer v{env.model_version}, change from v{self.version}")
        # the buffer names the sum: its round and version, as the aggregator's own label
        self.rnd = env.round
        self.masking.context = context(agent.job, env.round, env.model_version)
        return env, staleness_weight(tau)

    def run(
        self, change: np.ndarray, result: TrainResult, before_upload: Callable[[], None] = lambda: None
    ) -> bool:
        """Steps 2–4 for the trained ``change`` (flat_change); True once the client answered the unmasking
        request. ``before_upload`` runs between its inbox and its masked upload (the agent's fault there
        takes it down after it shared its keys: the dropout the protocol recovers from)."""
        try:
            return self._run(change, result, before_upload)
        except SecAggError as exc:
            self.agent._note_fault(self.rnd, f"secagg {exc.reason}: {exc}")
            log.warning(
                "secure aggregation refused: sitting the round out",
                client=self.agent.client,
                round=self.rnd,
                reason=exc.reason,
                detail=str(exc),
            )
            return False

    def _run(self, change: np.ndarray, result: TrainResult, before_upload: Callable[[], None]) -> bool:
        agent = self.agent
        env, stale = self._join_cohort()
        if env is None:
            return False  # the round went on without us (our keys came too late, or the buffer never took us)
        cohort, roster = payloads.cohort(env.payload)
        floor = env.payload["floor"]
        quantizer = Quantizer(self.clip, env.payload["bits"], len(cohort.members))
        self._send(Kind.SECAGG_SHARES, payloads.shares_payload(self.masking.share_keys(cohort, roster)))
        env = agent._wait_for(Kind.SECAGG_INBOX, self.rnd)
        if env is None or agent.client not in env.payload["inboxes"]:
            return False
        before_upload()
        n_max = env.payload["max_samples"]
        weight = 1.0 if n_max == 0 else min(result.n_samples, n_max) / n_max
        rng = np.random.default_rng(stable_seed(self.seed, agent.client, self.rnd, "secagg"))
        with MASKING:
            if self.dp is not None and stale < 1.0:  # weighed before quantizing: its noise share stays whole
                change, stale = self.dp.weigh(change, stale, self.rnd), 1.0
            x = quantizer.encode_weighted(change, weight, rng, stale)
            masked = self.masked(x, env.payload["inboxes"][agent.client])
            del x
            up = messages.secagg(
                Kind.MASKED, agent.job, self.rnd, agent.client, self.version, payloads.masked_payload(masked)
            )
            del masked
        agent._upload_masked(self.rnd, self.version, result, up)
        del up, change
        FREED.took()
        env = agent._wait_for(Kind.SECAGG_UNMASK, self.rnd)
        if env is None or agent.client not in env.payload["survivors"]:
            return False  # the round went on without us (our masked input came too late)
        if len(env.payload["survivors"]) < floor:
            raise SecAggError(
                "too-few-survivors", f"a sum of {len(env.payload['survivors'])}, {floor} needed"
            )
        answer = self.masking.unmask(payloads.unmask_request(env.payload))
        self._send(Kind.SECAGG_ANSWER, payloads.answer_payload(answer))
        return True

    def masked(self, x: np.ndarray, inbox: Mapping[str, bytes]) -> np.ndarray:
        """The quantized input ``x`` masked, in place, with its self mask and the pairwise masks of the
        neighbours in ``inbox``."""
        return self.masking.mask(x, inbox)

    def _send(self, kind: Kind, payload: dict) -> None:
        self._publish(self._message(kind, payload))

    def _message(self, kind: Kind, payload: dict) -> Envelope:
        agent = self.agent
        return messages.secagg(kind, agent.job, self.rnd, agent.client, self.version, payload)

    def _publish(self, env: Envelope) -> None:
        self.agent._send(env, topology.rk_report(self.agent.job, self.agent.client))
