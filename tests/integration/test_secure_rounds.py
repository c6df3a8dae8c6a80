"""Secure aggregation over the real RabbitMQ: an aggregator and two hosts of clients run synchronous rounds
with `secagg = true`, and the model is held against the same job run in the clear.

- the unmasked mean equals the plain FedAvg mean within the quantization bound;
- with 30 % of the cohort gone after sharing their keys, or after their masked upload, the round completes
  with the survivors' sum (equal to a plain run whose same clients drop);
- with fewer survivors than t the round is skipped in one line and the model is left as it was;
- a client's masked vector, as the aggregator holds it, passes a chi-square test of uniformity (its quantized
  input, the control, does not);
- a hostile client that sends a wrong-length vector is rejected by name and counted as dropped; one that
  sends a neighbour a damaged share is named by that neighbour, which sits the round out; one that answers the
  unmasking with a wrong share is named by the aggregator, which rebuilds the secret from the others: in
  every case the sum is the honest survivors' (never a silent wrong sum).

Asynchronous jobs (secure buffers, aggregator.secure_buffers), over the same hosts:

- every version's change equals BufferedAsync's Σ s(τ_k) n_k Δ_k / Σ n_k over the buffer's members, each
  weighing its change by its own staleness, within the quantization bound (stale members included);
- a hosted client whose check-in waits for a later buffer trains from the newer version meanwhile, and
  every version is still BufferedAsync's;
- with max_staleness 0, every check-in from an older version is refused and its client trains again from the
  newest: every buffer is fresh, and the job completes;
- a member gone after sharing its keys is left out and the buffer completes with the others;
- a buffer open when the aggregator stops is closed as skipped on resume, its members told, and the job
  completes;
- under client-mode DP, a stale member tops its weighed noise share back up to a whole one, the server adds
  nothing and divides by K, and every version is accounted.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from fold_reference import one_round_job
from load_factor import budget

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.engine import Engine
from fedmq.aggregator.runlog import read_rounds
from fedmq.aggregator.secure_round import unflatten as _unflatten
from fedmq.broker.transport.connect import connect
from fedmq.broker.transport.provision import purge
from fedmq.client_agent.agent import Agent, Offline
from fedmq.client_agent.availability import Faults
from fedmq.client_agent.host import Host
from fedmq.client_agent.secure_upload import SecureUpload
from fedmq.secagg import payloads
from fedmq.secagg.messages import UnmaskShares
from fedmq.secagg.quantize import Quantizer
from fedmq.secagg.shamir import Share

CLIENTS = 10
HOSTS = {"h0": [(0, 5)], "h1": [(5, 10)]}
CLIP = 4.0


@pytest.fixture(scope="module")
def task(tiny_lm):
    return tiny_lm(CLIENTS)


def _job(job: str, **extra) -> JobConfig:
    """A FedAvg round of every client, raw both ways (fold_reference.one_round_job), trained a little."""
    settings = dict(
        heartbeat_s=1.0,
        join_timeout_s=120,
        # a round with clients gone waits for them until its deadlines (an honest client of this model takes
        # well under a second to train and mask)
        report_deadline_s=budget(30),
        update_deadline_s=budget(15),
        max_steps=2,
        batch_size=4,
        lr=1.0,
        secagg_clip=CLIP,
    )
    return one_round_job(job, CLIENTS, **{**settings, **extra})


@dataclass
class Dropping(Faults):
    """crash-grant for the clients named, in round 1 only: under secure aggregation they go down after
    sharing their keys, before their masked upload; in the clear, before their upload."""

    clients: tuple[str, ...] = ()

    def draw(self, client: str, rnd: int) -> set[str]:
        return {"crash-grant"} if rnd == 1 and client in self.clients else set()


class SaysGoodbye(Agent):
    """Its crash-grant says it goes offline (the aggregator stops waiting for it at once, not at the
    round's deadline: the test is as strict and shorter)."""

    def _crash_after_grant(self, rnd: int, faults: set[str]) -> None:
        if "crash-grant" in faults:
            raise Offline("fault: gone after the grant", True)


@contextlib.contextmanager
def _hosts(task, cfg: JobConfig, url: str, agent_class: type[Agent] = SaysGoodbye, **agent_kw):
    """Two hosts (threads, one connection each) serving the job's clients while the block runs; then stopped
    (each must end cleanly), and the job's queues on the broker removed."""
    hosts = []
    for name, ranges in HOSTS.items():
        host = Host(
            lambda: connect(url),
            cfg.job,
            name,
            ranges,
            task,
            heartbeat_s=cfg.heartbeat_s,
            rejoin_s=0.5,
            **agent_kw,
        )
        host.agent_class = agent_class
        hosts.append(host)
    failures: list[BaseException] = []

    def serve(host: Host) -> None:
        try:
            host.run()
        except Exception as exc:  # a host must end cleanly, its parked rounds too
            failures.append(exc)

    threads = [threading.Thread(target=serve, args=(h,), daemon=True) for h in hosts]
    for t in threads:
        t.start()
    try:
        yield hosts
    finally:
        for h in hosts:
            h.stop.set()
        for t in threads:
            t.join(timeout=budget(20))
        purge(url, cfg.job, list(HOSTS))
    assert not failures and not any(t.is_alive() for t in threads), failures


def _engine(task, cfg: JobConfig, url: str, run_dir: Path) -> Engine:
    """The job's aggregator (``initial``: its model before round 1)."""
    engine = Engine(connect(url), task, cfg, run_dir, durable=False, evaluate=False)
    engine.initial = {k: v.clone() for k, v in engine.global_state.items()}
    engine.declare()
    return engine


def _run(
    task,
    cfg: JobConfig,
    url: str,
    run_dir: Path,
    agent_class: type[Agent] = SaysGoodbye,
    *,
    keep_states: bool = False,
    **agent_kw,
):
    """The aggregator and two hosts over ``url``, run to the job's end: the engine, its summary and the
    hosts. ``keep_states``: the engine keeps its model after every round (``engine.states``: round ->
    model)."""
    engine = _engine(task, cfg, url, run_dir)
    if keep_states:
        engine.states = {0: engine.initial}
        engine.on_round = lambda row: engine.states.update(
            {row["round"]: {k: v.clone() for k, v in engine.global_state.items()}}
        )
    with _hosts(task, cfg, url, agent_class, **agent_kw) as hosts:
        try:
            summary = engine.run()
        finally:
            engine.broker.close()
    return engine, summary, hosts


def _rows(engine: Engine) -> list:
    return list(read_rounds(engine.run_dir).records)


def _bound(cfg: JobConfig, n: int) -> float:
    """How far a secure mean of n of the cohort's inputs may be from the mean of their clipped updates, per
    coordinate: the sum's error n · step over Σ w ≥ n · min w (every client's w ≥ its n_k / n_max here)."""
    q = Quantizer.for_clients(n, cfg.secagg_clip)
    return (
        4 * q.step
    )  # Σ w ≥ n/4 for these shards, so (n · step) / Σ w ≤ 4 · step; and the weight's own rounding


def _close(a: Engine, b: Engine, atol: float) -> None:
    for name, value in a.global_state.items():
        torch.testing.assert_close(value, b.global_state[name], rtol=0, atol=atol)


def test_the_unmasked_mean_equals_the_plain_mean(task, rabbit_url, job_id, tmp_path):
    secure, summary, _ = _run(task, _job(job_id, secagg=True), rabbit_url, tmp_path / "secure")
    plain, *_ = _run(task, _job(job_id + "p"), rabbit_url, tmp_path / "plain")
    [row] = _rows(secure)
    assert not row.skipped and len(row.received) == CLIENTS
    assert secure.version == plain.version == 1
    # the models differ (the training moved them), and agree within the quantization bound
    moved = max(float((secure.global_state[k] - v).abs().max()) for k, v in secure.initial.items())
    assert moved > 100 * _bound(secure.cfg, CLIENTS)
    _close(secure, plain, _bound(secure.cfg, CLIENTS) + 1e-6)
    assert summary["rejected"] == {}


@pytest.mark.parametrize("when", ["after-sharing", "after-masking"])
def test_a_cohort_that_loses_30_percent_completes_with_the_survivors(
    task, rabbit_url, job_id, tmp_path, when
):
    gone = ("h0-1", "h0-3", "h1-7")

    class Vanishing(SecureUpload):
        def _send(self, kind, payload):  # after its masked upload, gone before it answers the unmasking
            if kind.value == "secagg-answer" and self.agent.client in gone:
                raise Offline("gone after masking", True)
            super()._send(kind, payload)

    class Agent30(SaysGoodbye):
        secure_upload = Vanishing if when == "after-masking" else SecureUpload

    faults = Dropping(clients=gone) if when == "after-sharing" else Faults()
    cfg = _job(job_id, secagg=True)
    secure, *_ = _run(task, cfg, rabbit_url, tmp_path / "secure", Agent30, faults=faults)
    [row] = _rows(secure)
    assert not row.skipped
    if when == "after-sharing":  # dropped: their pairwise masks were rebuilt from their neighbours' shares
        assert sorted(row.received) == sorted(set(_all()) - set(gone))
        plain, *_ = _run(
            task, _job(job_id + "p"), rabbit_url, tmp_path / "plain", faults=Dropping(clients=gone)
        )
        _close(secure, plain, _bound(cfg, CLIENTS - len(gone)) + 1e-6)
    else:  # survivors that did not answer: their self masks were rebuilt from the others' shares
        assert sorted(row.received) == _all()
        plain, *_ = _run(task, _job(job_id + "p"), rabbit_url, tmp_path / "plain")
        _close(secure, plain, _bound(cfg, CLIENTS) + 1e-6)


def _all() -> list[str]:
    return sorted(f"h{0 if i < 5 else 1}-{i}" for i in range(CLIENTS))


def test_fewer_survivors_than_t_skip_the_round_and_leave_the_model(task, rabbit_url, job_id, tmp_path):
    gone = tuple(_all()[:8])  # 2 of 10 left: each survivor's seed has fewer than t holders left to answer
    cfg = _job(job_id, secagg=True)
    engine, summary, _ = _run(task, cfg, rabbit_url, tmp_path / "run", faults=Dropping(clients=gone))
    [row] = _rows(engine)
    assert row.skipped and row.skip_reason.startswith("secure aggregation: ")
    assert "\n" not in row.skip_reason and not row.received
    assert engine.version == 0 and summary["rounds_skipped"] == 1  # nothing published
    for name, value in engine.initial.items():  # the model as it was, bit for bit
        assert torch.equal(engine.global_state[name], value)
    assert engine.strategy_state == {}


def test_a_masked_vector_as_the_aggregator_holds_it_is_uniform(
    task, rabbit_url, job_id, tmp_path, monkeypatch
):
    held: list[np.ndarray] = []
    real = payloads.masked
    monkeypatch.setattr(payloads, "masked", lambda p: held.append(real(p).copy()) or held[-1])
    inputs: list[np.ndarray] = []

    class Recording(SecureUpload):
        def masked(self, x, inbox):
            inputs.append(x.copy())
            return super().masked(x, inbox)

    class RecordingAgent(SaysGoodbye):
        secure_upload = Recording

    _run(task, _job(job_id, secagg=True), rabbit_url, tmp_path / "run", RecordingAgent)
    assert len(held) == CLIENTS and len(inputs) == CLIENTS

    def chi2_p(v: np.ndarray) -> float:
        from scipy.stats import chisquare

        counts = np.bincount((v >> np.uint32(24)).astype(np.int64), minlength=256)
        return float(chisquare(counts).pvalue)

    assert chi2_p(held[0]) > 1e-4  # uniform in Z_2^32 (a false alarm once in 10,000 runs)
    assert chi2_p(inputs[0]) < 1e-12  # the control: the quantized input it hides is not


def test_hostile_clients_are_named_and_the_sum_stays_the_honest_survivors(task, rabbit_url, job_id, tmp_path):
    """h0-2 uploads a vector one coordinate short; h1-6 damages the share it sends one neighbour; h0-4
    answers the unmasking with a wrong share of every seed it holds."""
    damaged: dict[str, str] = {}

    class Hostile(SecureUpload):
        def masked(self, x, inbox):
            y = super().masked(x, inbox)
            return y[:-1] if self.agent.client == "h0-2" else y

        def _send(self, kind, payload):
            me = self.agent.client
            if kind.value == "secagg-shares" and me == "h1-6":
                victim = next(v for v in sorted(payload["shares"]) if v not in ("h0-2", "h0-4"))
                damaged[me] = victim
                ct = bytearray(payload["shares"][victim])
                ct[-1] ^= 1
                payload = {**payload, "shares": {**payload["shares"], victim: bytes(ct)}}
            if kind.value == "secagg-answer" and me == "h0-4":
                answer = payloads.unmask_shares(payload)
                wrong = {v: Share(s.index, bytes(16)) for v, s in answer.seeds.items()}
                payload = payloads.answer_payload(UnmaskShares(wrong, answer.keys))
            super()._send(kind, payload)

    class HostileAgent(SaysGoodbye):
        secure_upload = Hostile

    cfg = _job(job_id, secagg=True)
    engine, summary, hosts = _run(task, cfg, rabbit_url, tmp_path / "secure", HostileAgent)
    [row] = _rows(engine)
    victim = damaged["h1-6"]
    assert not row.skipped
    assert summary["rejected"].get("bad-length") == 1  # h0-2's vector, named in the log
    out = {"h0-2", victim}  # the victim found the damaged share and sat the round out
    why = " ".join(why for h in hosts if victim in h.logs for _, why in h.logs[victim].faults)
    assert "h1-6" in why and "fail authentication" in why
    assert summary["rejected"].get("bad-share", 0) >= 1  # h0-4's wrong shares, found and left out
    assert sorted(row.received) == sorted(set(_all()) - out)
    plain, *_ = _run(
        task, _job(job_id + "p"), rabbit_url, tmp_path / "plain", faults=Dropping(clients=tuple(out))
    )
    _close(engine, plain, _bound(cfg, CLIENTS - 2) + 1e-6)


def _answering(answering: threading.Event) -> type[SecureUpload]:
    """A client side that sets ``answering`` as it answers round 1's unmasking request."""

    class Answering(SecureUpload):
        def _send(self, kind, payload):
            if kind.value == "secagg-answer" and self.rnd == 1:
                answering.set()
            super()._send(kind, payload)

    return Answering


def test_a_round_stopped_mid_unmasking_is_dropped_on_resume_and_nothing_of_an_input_was_written(
    task, rabbit_url, job_id, tmp_path
):
    """The aggregator stops while the survivors' unmasking answers are on their way; its spool then holds
    the round's selection and reports and nothing of any client's input. Resumed, it closes that round as
    skipped (the shares and the masked sum were in the stopped aggregator's memory only) and the next round
    runs with every client."""
    answering = threading.Event()

    class AnsweringAgent(SaysGoodbye):
        secure_upload = _answering(answering)

    cfg = _job(job_id, secagg=True, rounds=2)
    run_dir = tmp_path / "run"
    first = _engine(task, cfg, rabbit_url, run_dir)
    with _hosts(task, cfg, rabbit_url, AnsweringAgent):
        threading.Thread(target=lambda: answering.wait(budget(120)) and first.stop.set(), daemon=True).start()
        first.run()
        first.broker.close()
        assert answering.is_set() and first.version == 0 and not _rows(first)
        spooled = sorted(p.name for p in (run_dir / "spool").rglob("*") if p.is_file())
        state, updates = first.spool.load(1)
        assert state is not None and updates == [], spooled  # the round's state; no update, masked or not
        second = Engine(connect(rabbit_url), task, cfg, run_dir, durable=False, evaluate=False)
        summary = second.run()
        second.broker.close()
    one, two = _rows(second)
    assert one.skipped and one.skip_reason.startswith("secure round interrupted by a restart")
    assert not two.skipped and len(two.received) == CLIENTS
    assert second.version == 1 and summary["rounds_completed"] == 1


# ---------------------------------------------------------------------------------------- secure buffers
BUFFER = 4


def _async_job(job: str, **extra) -> JobConfig:
    """An asynchronous job of 3 versions, buffers of BUFFER, under secure aggregation; no weight is capped,
    so that a buffer's mean is BufferedAsync's over the members' own n_k."""
    settings = dict(strategy="async", rounds=3, secagg=True, max_samples_factor=0.0)
    args = {"buffer_size": BUFFER, **extra.pop("strategy_args", {})}
    return _job(job, **{**settings, "strategy_args": args, **extra})


@dataclass
class Masked:
    """What one member of a buffer put in: its change, n_k and the version it trained from."""

    change: np.ndarray
    n_samples: int
    base: int


def _recording(inputs: dict[int, dict[str, Masked]], base: type[SecureUpload] = SecureUpload):
    """An agent class whose clients record what they masked, by buffer round (a subclass of ``base``)."""

    class Recording(base):  # type: ignore[misc, valid-type]
        def run(self, change, result, before_upload=lambda: None):
            kept = change.copy()
            done = super().run(change, result, before_upload)
            if done:
                inputs.setdefault(self.rnd, {})[self.agent.client] = Masked(
                    kept, result.n_samples, self.version
                )
            return done

    class RecordingAgent(SaysGoodbye):
        secure_upload = Recording

    return RecordingAgent


def _check_buffers(engine: Engine, inputs: dict[int, dict[str, Masked]]) -> int:
    """Each published version against BufferedAsync's mean of its members' recorded changes; the stale
    members seen."""
    from fedmq.staleness import staleness_weight

    stale, version = 0, 0
    for row in _rows(engine):
        before, after = engine.states[row.round - 1], engine.states[row.round]
        if row.skipped:
            continue
        members = inputs[row.round]
        assert sorted(members) == sorted(row.received)
        total = sum(m.n_samples for m in members.values())
        mean = sum(staleness_weight(version - m.base) * m.n_samples * m.change for m in members.values())
        expected = _unflatten(mean / total, before)
        stale += sum(m.base < version for m in members.values())
        for name, value in expected.items():
            torch.testing.assert_close(
                after[name] - before[name],
                value.to(after[name].dtype),
                rtol=0,
                atol=_bound(engine.cfg, len(members)) + 1e-6,
            )
        version += 1
    return stale


def test_secure_buffers_fold_each_members_change_with_its_own_staleness(task, rabbit_url, job_id, tmp_path):
    inputs: dict[int, dict[str, Masked]] = {}
    cfg = _async_job(job_id)
    engine, summary, _ = _run(task, cfg, rabbit_url, tmp_path / "run", _recording(inputs), keep_states=True)
    rows = _rows(engine)
    assert engine.version == 3 and all(not r.skipped and len(r.received) == BUFFER for r in rows)
    # 10 clients check in from version 0 and a buffer takes 4: the later buffers take the stale ones first
    assert _check_buffers(engine, inputs) >= BUFFER
    assert summary["rejected"] == {}


def _watched(inputs: dict[int, dict[str, Masked]], overlaps: list[tuple[str, int]]) -> type[Agent]:
    """A recording agent class (_recording) that also notes in ``overlaps`` each (client, round) trained while
    a check-in of the same client was out and not yet settled."""
    out: dict[str, int] = {}  # client -> its check-ins out and not yet settled
    lock = threading.Lock()

    class Counting(SecureUpload):
        def run(self, change, result, before_upload=lambda: None):
            try:
                return super().run(change, result, before_upload)
            finally:
                with lock:
                    out[self.agent.client] -= 1

    class Watched(_recording(inputs, Counting)):  # type: ignore[misc]
        def _checked_in(self, version):
            with lock:
                out[self.client] = out.get(self.client, 0) + 1
            super()._checked_in(version)

        def _train(self, model, held, cfg, rnd, crash, hooks=()):
            with lock:
                if out.get(self.client, 0) > 0:
                    overlaps.append((self.client, rnd))
            return super()._train(model, held, cfg, rnd, crash, hooks)

    return Watched


def test_a_hosted_client_trains_from_a_newer_version_while_its_check_in_waits(
    task, rabbit_url, job_id, tmp_path
):
    inputs: dict[int, dict[str, Masked]] = {}
    overlaps: list[tuple[str, int]] = []
    # buffers of 3 from 10 clients: a check-in waits through at least one announcement after it is out (a
    # whole buffer's steps), and its host trains the client from that version meanwhile
    cfg = _async_job(job_id, rounds=5, strategy_args={"buffer_size": 3})
    engine, _, _ = _run(task, cfg, rabbit_url, tmp_path / "run", _watched(inputs, overlaps), keep_states=True)
    assert engine.version == 5
    assert overlaps and all(rnd > 1 for _, rnd in overlaps)
    _check_buffers(engine, inputs)  # and every version is still BufferedAsync's


def test_with_no_staleness_allowed_every_older_check_in_is_refused_and_every_buffer_is_fresh(
    task, rabbit_url, job_id, tmp_path
):
    inputs: dict[int, dict[str, Masked]] = {}
    cfg = _async_job(job_id, strategy_args={"max_staleness": 0})
    engine, summary, _ = _run(task, cfg, rabbit_url, tmp_path / "run", _recording(inputs), keep_states=True)
    assert engine.version == 3
    assert _check_buffers(engine, inputs) == 0  # every member trained from the buffer's own version
    assert summary["dropped"].get("too-stale", 0) >= CLIENTS - BUFFER  # told, and trained again


def test_a_buffer_member_gone_after_sharing_is_left_out_and_the_buffer_completes(
    task, rabbit_url, job_id, tmp_path
):
    inputs: dict[int, dict[str, Masked]] = {}
    gone: list[str] = []

    class Leaving(SecureUpload):
        def _send(self, kind, payload):  # the first member to share its keys goes, before its masked upload
            super()._send(kind, payload)
            if kind.value == "secagg-shares" and not gone:
                gone.append(self.agent.client)
                raise Offline("gone after sharing", True)

    cfg = _async_job(job_id)
    agent = _recording(inputs, Leaving)
    engine, _, _ = _run(task, cfg, rabbit_url, tmp_path / "run", agent, keep_states=True)
    first = _rows(engine)[0]
    assert not first.skipped and gone and gone[0] not in first.received
    assert len(first.received) == BUFFER - 1
    assert engine.version == 3
    _check_buffers(engine, inputs)


def test_a_buffer_open_at_a_stop_is_dropped_on_resume_its_members_told(task, rabbit_url, job_id, tmp_path):
    answering = threading.Event()
    inputs: dict[int, dict[str, Masked]] = {}
    # every client in every buffer: the job goes on only if the hosts train the interrupted buffer's members
    # again from the same version, and they check in again
    cfg = _async_job(job_id, strategy_args={"buffer_size": CLIENTS})
    run_dir = tmp_path / "run"
    first = _engine(task, cfg, rabbit_url, run_dir)
    with _hosts(task, cfg, rabbit_url, _recording(inputs, _answering(answering))):
        threading.Thread(target=lambda: answering.wait(budget(120)) and first.stop.set(), daemon=True).start()
        first.run()
        first.broker.close()
        assert answering.is_set() and first.version == 0
        state, updates = first.spool.load(1)
        assert state is not None and len(state["members"]) == CLIENTS and updates == []
        second = Engine(connect(rabbit_url), task, cfg, run_dir, durable=False, evaluate=False)
        summary = second.run()
        second.broker.close()
    rows = _rows(second)
    assert rows[0].skipped and rows[0].skip_reason.startswith("secure round interrupted by a restart")
    assert second.version == 3 and summary["rounds_completed"] == 3
    assert all(len(r.received) == CLIENTS for r in rows[1:])


@dataclass
class Weighed:
    """A stale member's change as it trained it (clipped and noised) and as it masked it (ClientDP.weigh)."""

    weight: float
    trained: np.ndarray
    masked: np.ndarray


def _weighing(inputs: dict[int, dict[str, Masked]], weighed: list[Weighed]) -> type[Agent]:
    """A recording agent class (_recording) under client-mode DP whose members record the change they masked:
    a stale one's as ClientDP.weigh gave it (also noted in ``weighed``), a fresh one's as it trained it."""

    class Weighing(SecureUpload):
        def run(self, change, result, before_upload=lambda: None):
            hook = self.dp
            assert hook is not None  # the job's client-mode DP reached the secure upload
            weigh = hook.weigh

            def recorded(trained, weight, rnd):
                masked = weigh(trained, weight, rnd)
                weighed.append(Weighed(weight, trained.copy(), masked.copy()))
                change_in[0] = masked
                return masked

            change_in = [change.copy()]
            hook.weigh = recorded  # type: ignore[method-assign]
            done = super().run(change, result, before_upload)
            if done:
                inputs.setdefault(self.rnd, {})[self.agent.client] = Masked(change_in[0], 1, self.version)
            return done

    class WeighingAgent(SaysGoodbye):
        secure_upload = Weighing

    return WeighingAgent


def test_distributed_dp_in_secure_buffers_keeps_a_stale_members_noise_share_whole(
    task, rabbit_url, job_id, tmp_path
):
    """Client-mode DP with secure buffers: a stale member weighs its clipped, noised change by s(τ) and tops
    its noise share back up to σ = z·S/√m_min; the server adds nothing (its sum holds at least m_min whole
    shares) and divides by the fixed denominator (K, which every buffer here fills); every version is
    accounted."""
    inputs: dict[int, dict[str, Masked]] = {}
    weighed: list[Weighed] = []
    z, s_norm, m_min = 0.05, 1.0, 3
    cfg = _async_job(job_id, dp="client", clip_norm=s_norm, noise_multiplier=z, min_clients=m_min)
    engine, summary, _ = _run(
        task, cfg, rabbit_url, tmp_path / "run", _weighing(inputs, weighed), keep_states=True
    )
    rows = _rows(engine)
    assert engine.version == 3 and summary["rejected"] == {}
    epsilons = [r.epsilon for r in rows]
    assert all(e is not None and e > 0 for e in epsilons) and epsilons == sorted(epsilons)
    assert weighed  # buffers after the first take check-ins from older versions
    sigma = z * s_norm / np.sqrt(m_min)
    for w in weighed:
        assert 0 < w.weight < 1
        topped = (w.masked - w.weight * w.trained).astype(np.float64)
        assert float(topped.std()) == pytest.approx(sigma * np.sqrt(1 - w.weight**2), rel=0.1)
    for row in rows:
        before, after = engine.states[row.round - 1], engine.states[row.round]
        members = inputs[row.round]
        assert not row.skipped and sorted(members) == sorted(row.received)
        mean = sum(m.change for m in members.values()) / BUFFER  # the fixed denominator K, nothing added
        for name, value in _unflatten(mean, before).items():
            torch.testing.assert_close(
                after[name] - before[name],
                value.to(after[name].dtype),
                rtol=0,
                atol=_bound(cfg, BUFFER) + 1e-6,
            )


def test_scaffold_sums_its_model_and_control_variate_changes_securely(task, rabbit_url, job_id, tmp_path):
    """One secure sum of every client's (Δy_i, Δc_i): x and c as the same round in the clear gives them."""
    cfg = _job(job_id, secagg=True, strategy="scaffold")
    secure, summary, _ = _run(task, cfg, rabbit_url, tmp_path / "secure")
    plain, *_ = _run(task, _job(job_id + "p", strategy="scaffold"), rabbit_url, tmp_path / "plain")
    [row] = _rows(secure)
    assert not row.skipped and len(row.received) == CLIENTS and summary["rejected"] == {}
    controls = [k for k in secure.global_state if k.startswith("scaffold.c:")]
    assert controls and all(float(secure.global_state[k].abs().max()) > 0 for k in controls)  # c moved
    _close(secure, plain, _bound(cfg, CLIENTS) + 1e-6)
