"""Hostile input over a real broker (an isolated RabbitMQ node with one user per agent, strict identity).

While round 1 is open (the legitimate agents are selected but have not trained yet), the test sends, with
valid and forged identities: random bytes, truncated and bit-flipped envelopes, zstd and msgpack bombs,
tensors with wrong names / shapes / dtypes, NaN and Inf, updates for closed and future rounds, replays, a
client id that differs from the AMQP user, a forged AMQP user_id (refused by RabbitMQ itself), bad, duplicate
and never-completed chunks, and then ~1500 hypothesis-generated messages. Every message must be rejected or
dropped with a reason and a counter (predicted per message), the aggregator keeps running, and the global
model stays unchanged. Then the real agents run round 1: the global model is exactly FedAvg of their updates,
and nothing else was folded.
"""

from __future__ import annotations

import math
import threading
import time

import msgpack
import numpy as np
import pika
import pytest
import torch
import zstandard as zstd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from load_factor import budget

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.engine import Engine
from fedmq.broker.transport import topology
from fedmq.broker.transport.connect import connect
from fedmq.broker.wire import messages
from fedmq.broker.wire.blobs import digest
from fedmq.broker.wire.chunk_frames import CHUNK_HEADER, encode_chunk, split
from fedmq.broker.wire.encodings import EncodingSpec, encode_state
from fedmq.broker.wire.envelope import MAGIC, SCHEMA_VERSION
from fedmq.client_agent.agent import Agent
from fedmq.tasks.base import model_state

pytestmark = [pytest.mark.isolated_node, pytest.mark.slow]

AGENTS = ("agent-0", "agent-1")
MALLORY = "mallory"  # an authenticated user that is not part of the federation


def raw_frame(body: bytes, flags: int = 0) -> bytes:
    return b"".join((MAGIC, bytes((SCHEMA_VERSION, flags)), digest(body), body))


def frame(obj: object, compress: bool = False) -> bytes:
    """A wire message around any msgpack body, with a correct digest (so it reaches the deeper checks)."""
    body = msgpack.packb(obj, use_bin_type=True)
    flags = 0
    if compress:
        body, flags = zstd.ZstdCompressor(write_content_size=True).compress(body), 1
    return b"".join((MAGIC, bytes((SCHEMA_VERSION, flags)), digest(body), body))


class Rig:
    """The engine under attack and its counters."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def handled(self) -> int:
        return sum(self.engine.inbox.rejected.values()) + sum(self.engine.inbox.dropped.values())

    def wait_handled(self, n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + budget(timeout)
        while self.handled() < n and time.monotonic() < deadline:
            time.sleep(0.002)
        assert self.handled() >= n, f"only {self.handled()} of {n} hostile messages were rejected/dropped"


@pytest.fixture(scope="module")
def task(tiny_lm):
    return tiny_lm(2)


def _user_url(node, user: str) -> str:
    return f"amqp://{user}:pw-{user}@127.0.0.1:{node.port}/%2F"


def test_hostile_messages_are_rejected_and_change_nothing(rabbit_node, job_id, task, tmp_path):
    node = rabbit_node
    for user in (*AGENTS, MALLORY):
        node.ctl("add_user", user, f"pw-{user}", check=False)
        node.ctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
    cfg = JobConfig(
        job=job_id,
        strategy="fedavg",
        rounds=1,
        clients=2,
        fraction=1.0,
        lr=5.0,
        max_steps=3,
        batch_size=4,
        heartbeat_s=60,
        join_timeout_s=60,
        report_deadline_s=600,
        update_deadline_s=60,
        identity="strict",
        encoding="raw",
        down_encoding="raw",
    )  # raw: the aggregate is checked exactly
    admin = connect(node.url)
    admin.declare_job(job_id, list(AGENTS))
    engine = Engine(connect(node.url), task, cfg, tmp_path / "run", durable=False, evaluate=False)
    rig = Rig(engine)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(engine.run()), daemon=True)
    runner.start()
    pubs = {u: connect(_user_url(node, u)) for u in (*AGENTS, MALLORY)}
    try:
        for a in AGENTS:  # the legitimate agents say hello (from their own users), so round 1 selects them
            env = messages.presence(job_id, a, "online", -1)
            pubs[a].publish(topology.rk_presence(job_id, a), messages.encode(env), message_id=env.msg_id)
        deadline = time.monotonic() + budget(30)
        while engine.phase != "training" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.phase == "training" and engine.round == 1
        before = {k: v.clone() for k, v in engine.global_state.items()}

        sent = 0

        def send(who: str, body: bytes, rk_client: str | None = None, kind: str = "update") -> None:
            nonlocal sent
            client = rk_client or who
            rk = (
                topology.rk_update(job_id, client) if kind == "update" else topology.rk_report(job_id, client)
            )
            pubs[who].publish(rk, body)
            sent += 1

        # ---------------------------------------------------------------- hand-written attacks
        state = {k: v.detach().float() for k, v in model_state(task.build_model(0)).items()}
        good_tensors = encode_state(state, EncodingSpec.parse("raw"))

        def update_env(client: str, rnd: int = 1, version: int = 0, tensors=None) -> bytes:
            env = messages.update(job_id, rnd, client, version, 1.0, 10, tensors or good_tensors)
            return messages.encode(env)

        valid = update_env("agent-0")
        name0 = next(iter(state))
        wrong_name = encode_state({("x" + k): v for k, v in state.items()}, EncodingSpec.parse("raw"))
        wrong_shape = encode_state(
            {k: torch.zeros(3, 7) if k == name0 else v for k, v in state.items()}, EncodingSpec.parse("raw")
        )
        nan = encode_state(
            {k: torch.full_like(v, math.nan) if k == name0 else v for k, v in state.items()},
            EncodingSpec.parse("raw"),
        )
        inf = encode_state(
            {k: torch.full_like(v, math.inf) if k == name0 else v for k, v in state.items()},
            EncodingSpec.parse("raw"),
        )
        wrong_dtype = encode_state(
            {k: v.double() if k == name0 else v for k, v in state.items()}, EncodingSpec.parse("raw")
        )
        unzstd = zstd.ZstdCompressor(write_content_size=False).compressobj()
        zbomb_body = unzstd.compress(b"\0" * (8 << 20)) + unzstd.flush()  # no declared size: refused unread
        attacks = [
            (
                "random bytes",
                MALLORY,
                bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)),
                None,
            ),
            ("empty", MALLORY, b"", None),
            ("truncated", "agent-0", valid[: len(valid) // 2], None),
            ("bit flip", "agent-0", valid[:40] + bytes([valid[40] ^ 0x10]) + valid[41:], None),
            ("zstd bomb", MALLORY, raw_frame(zbomb_body, 1), None),
            ("msgpack bomb", MALLORY, raw_frame(b"\xdd\xff\xff\xff\xff"), None),
            ("msgpack deep nesting", MALLORY, raw_frame(b"\x91" * 100_000), None),
            ("msgpack huge str", MALLORY, raw_frame(b"\xdb\x7f\xff\xff\xff" + b"a" * 100), None),
            ("wrong tensor names", "agent-0", update_env("agent-0", tensors=wrong_name), None),
            ("wrong shapes", "agent-0", update_env("agent-0", tensors=wrong_shape), None),
            ("float64 tensor", "agent-0", update_env("agent-0", tensors=wrong_dtype), None),
            ("NaN", "agent-0", update_env("agent-0", tensors=nan), None),
            ("Inf", "agent-0", update_env("agent-0", tensors=inf), None),
            ("closed round", "agent-0", update_env("agent-0", rnd=0), None),
            ("future round", "agent-0", update_env("agent-0", rnd=7), None),
            ("wrong base version", "agent-1", update_env("agent-1", version=5), None),
            ("claims another client", MALLORY, update_env("agent-0"), "agent-0"),
            ("claims another client (own key)", "agent-1", update_env("agent-0"), None),
            ("not selected", MALLORY, update_env(MALLORY), None),
            (
                "other job",
                "agent-0",
                messages.encode(messages.update("otherjob", 1, "agent-0", 0, 1.0, 10, good_tensors)),
                None,
            ),
            ("aggregator kind", MALLORY, messages.encode(messages.grant(job_id, 1, 0, [MALLORY])), None),
        ]
        for name, who, body, rk_client in attacks:
            before_n = rig.handled()
            send(who, body, rk_client)
            rig.wait_handled(before_n + 1)
            assert runner.is_alive(), f"the aggregator died on {name!r}"
        # a replay: the same bytes again (duplicate of a rejected update: rejected again for the same reason)
        send("agent-0", update_env("agent-0", tensors=nan))
        rig.wait_handled(sent)
        assert "agent-0" not in engine.inbox.dropped  # sanity: counters are keyed by reason
        reasons = dict(engine.inbox.rejected)
        assert reasons.get("identity-mismatch", 0) == 2 and reasons.get("wrong-job", 0) == 1, reasons
        assert reasons.get("rejected-by-strategy", 0) + reasons.get("non-finite", 0) >= 3, reasons
        assert (
            engine.inbox.dropped.get("stale-round", 0) == 1
            and engine.inbox.dropped.get("future-round", 0) == 1
        )
        assert engine.inbox.dropped.get("not-selected", 0) == 1

        # -------------------------------------------------------------- forged AMQP user_id: RabbitMQ refuses
        params = pika.URLParameters(_user_url(node, MALLORY))
        conn = pika.BlockingConnection(params)
        ch = conn.channel()
        ch.confirm_delivery()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            ch.basic_publish(
                topology.exchange(job_id),
                topology.rk_update(job_id, "agent-0"),
                valid,
                pika.BasicProperties(user_id="agent-0", delivery_mode=2),
                mandatory=True,
            )
        assert refused.value.reply_code == 406
        conn.close()

        # ------------------------------------------------------------- chunks: bad, duplicate, never complete
        ch_conn = pika.BlockingConnection(pika.URLParameters(_user_url(node, MALLORY)))
        cch = ch_conn.channel()
        cch.confirm_delivery()
        hdr = pika.BasicProperties(user_id=MALLORY, delivery_mode=2, headers={CHUNK_HEADER: 1})
        chunks = split(update_env(MALLORY), "m-incomplete", 1024)
        assert len(chunks) > 3
        for _ in range(3):  # duplicate first chunks of a message that never completes
            cch.basic_publish(
                topology.exchange(job_id), topology.rk_update(job_id, MALLORY), encode_chunk(chunks[0]), hdr
            )
        cch.basic_publish(
            topology.exchange(job_id), topology.rk_update(job_id, MALLORY), b"\x99garbage-chunk", hdr
        )
        for i in range(100):  # many messages that never complete: the prefetch window must not fill up
            c = split(update_env(MALLORY), f"m-open-{i}", 1024)[0]
            cch.basic_publish(
                topology.exchange(job_id), topology.rk_update(job_id, MALLORY), encode_chunk(c), hdr
            )
        ch_conn.close()

        # -------------------------------------------------------- hypothesis: thousands of generated messages
        ids = st.sampled_from(["agent-0", "agent-1", MALLORY, "x", "", "../etc", "a" * 70])
        kinds = st.sampled_from(
            ["presence", "announce", "report", "grant", "update", "model", "bogus", 3, None]
        )
        scalars = st.one_of(
            st.integers(-(2**63), 2**64 - 1),
            st.floats(allow_nan=True),
            st.text(max_size=8),
            st.binary(max_size=16),
            st.none(),
            st.booleans(),
        )
        tensor_rec = st.fixed_dictionaries(
            {
                "n": st.sampled_from([name0, "bogus"]),
                "s": st.lists(st.integers(-1, 40), max_size=3),
                "dt": st.sampled_from(["f32", "f16", "x"]),
                "e": st.sampled_from(["raw", "int8", "int4", "topk"]),
                "x": st.binary(max_size=64),
            }
        )
        payloads = st.one_of(
            st.dictionaries(st.text(max_size=8), scalars, max_size=4),
            st.fixed_dictionaries(
                {
                    "loss": st.one_of(st.floats(), st.integers(-(2**63), 2**63 - 1)),
                    "n_samples": st.integers(-5, 2**60),
                    "tensors": st.one_of(
                        scalars,
                        st.fixed_dictionaries(
                            {"fmt": scalars, "enc": scalars, "t": st.lists(tensor_rec, max_size=3)}
                        ),
                    ),
                }
            ),
            st.fixed_dictionaries({"state": st.sampled_from(["online", "offline", "zzz"]), "holds": scalars}),
        )
        envelopes = st.tuples(
            kinds,
            st.sampled_from([job_id, "otherjob", "", 5]),
            st.integers(-3, 3),
            ids,
            st.integers(-3, 3),
            st.text(min_size=0, max_size=10),
            st.floats(),
            payloads,
        )
        message = st.one_of(
            st.binary(max_size=300),
            st.builds(lambda e, z: frame(list(e), z), envelopes, st.booleans()),
            st.builds(lambda e, cut: frame(list(e))[:cut], envelopes, st.integers(0, 60)),
            st.builds(
                lambda e, pos, bit: (
                    lambda b: (
                        b[: pos % len(b)] + bytes([b[pos % len(b)] ^ (1 << bit)]) + b[pos % len(b) + 1 :]
                    )
                )(frame(list(e))),
                envelopes,
                st.integers(0, 10_000),
                st.integers(0, 7),
            ),
        )
        presence_ok = 0

        @settings(
            max_examples=1500,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(body=message)
        def one(body: bytes) -> None:
            who = (
                MALLORY  # valid-identity attacks are the hand-written ones above (a valid report would count)
            )
            nonlocal presence_ok
            # the oracle: a valid presence from its own user is the only message the aggregator may accept
            try:
                env = messages.decode(body)
                accepted = env.kind.value == "presence" and env.job == job_id and env.client == who
            except Exception:
                accepted = False
            n = rig.handled()
            send(who, body)
            if accepted:
                presence_ok += 1
                time.sleep(0.01)
                assert rig.handled() == n
            else:
                rig.wait_handled(n + 1)
            assert runner.is_alive()

        t0 = time.monotonic()
        one()
        fuzz_s = time.monotonic() - t0
        assert fuzz_s < budget(90), f"fuzzing took {fuzz_s:.0f}s"
        # nothing hostile reached the model, the round is still open and the aggregator is alive
        assert runner.is_alive() and engine.version == 0 and engine.round == 1
        for k, v in before.items():
            assert torch.equal(engine.global_state[k], v)
        print(
            f"hostile: {sent} messages in total, {fuzz_s:.1f}s of fuzzing; "
            f"rejected={dict(engine.inbox.rejected)} dropped={dict(engine.inbox.dropped)} "
            f"presence accepted={presence_ok}"
        )

        # ---------------------------------------------------------------- the real agents finish round 1
        agents = []
        for i, a in enumerate(AGENTS):
            agent = Agent(
                lambda u=a: connect(_user_url(node, u)), job_id, a, i, task, heartbeat_s=60, rejoin_s=0.2
            )
            agent.log.sent = {}
            agents.append(agent)
        threads = [threading.Thread(target=ag.run, daemon=True) for ag in agents]
        for t in threads:
            t.start()
        runner.join(timeout=budget(120))
        assert not runner.is_alive() and result["rounds_completed"] == 1
        for ag in agents:
            ag.stop.set()
        for t in threads:
            t.join(timeout=budget(10))
        uploads = sorted(u for ag in agents for (r, u) in ag.log.uploads if r == 1)
        assert sorted(engine.folded[1]) == uploads and len(uploads) == 2
        sent_states = [ag.log.sent[1] for ag in agents]
        total = sum(n for n, _ in sent_states)
        for name in before:
            want = sum(n * s[name].double() for n, s in sent_states) / total
            torch.testing.assert_close(engine.global_state[name].double(), want, rtol=1e-5, atol=1e-6)
    finally:
        engine.stop.set()
        runner.join(timeout=budget(10))
        for p in pubs.values():
            p.close()
        admin.close()
