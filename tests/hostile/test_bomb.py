"""Decompression bombs against a running aggregator on the shared RabbitMQ: each is rejected with reason
"bomb" while the aggregator's peak memory grows by less than one model's worth (plus interpreter slack), the
rejected messages wait in the job's dead-letter queue,
and the round then completes with the real agents' updates.

Peak memory is this process's VmHWM (the engine runs in-process), reset before each bomb through
/proc/self/clear_refs, so it measures what handling that one message cost.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
import zstandard as zstd
from load_factor import budget

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.engine import Engine
from fedmq.broker.transport import topology
from fedmq.broker.transport.connect import connect
from fedmq.broker.transport.provision import purge
from fedmq.broker.wire import messages
from fedmq.broker.wire.blobs import digest
from fedmq.broker.wire.chunk_frames import CHUNK_HEADER, encode_chunk, split
from fedmq.broker.wire.encodings import EncodingSpec, encode_state
from fedmq.broker.wire.envelope import FLAG_ZSTD, MAGIC, SCHEMA_VERSION
from fedmq.client_agent.agent import Agent
from fedmq.tasks.base import model_state

pytestmark = pytest.mark.rabbitmq

AGENTS = ("agent-0", "agent-1")
INFLATED = (
    256 << 20
)  # what each bomb expands to; today's 2 GiB limit let the envelope's body inflate this far
SLACK = 32 << 20  # interpreter and allocator noise allowed on top of one model


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/self/status")


def _zeros_frame(prefix: bytes, n: int, *, declare: bool) -> bytes:
    """A zstd frame of ``prefix`` + ``n`` zero bytes (a few KiB), with or without its content size."""
    c = zstd.ZstdCompressor(level=1, write_content_size=declare)
    z = c.compressobj(size=len(prefix) + n if declare else -1)
    out = [z.compress(prefix)]
    block = bytes(1 << 20)
    for _ in range(n >> 20):
        out.append(z.compress(block))
    out.append(z.flush())
    return b"".join(out)


def _wire(body: bytes, flags: int) -> bytes:
    return b"".join((MAGIC, bytes((SCHEMA_VERSION, flags)), digest(body), body))


def _update_prefix(job: str, client: str) -> bytes:
    """An update envelope's msgpack up to its tensors value, which is then a bin of INFLATED bytes."""
    head = msgpack.packb(["update", job, 1, client, 0, "bomb-" + client, time.time()], use_bin_type=True)
    head = b"\x98" + head[1:]  # an 8-element array: the payload map follows
    return (
        head
        + b"\x83"
        + msgpack.packb("loss")
        + msgpack.packb(1.0)
        + msgpack.packb("n_samples")
        + msgpack.packb(10)
        + msgpack.packb("tensors")
        + b"\xc6"
        + INFLATED.to_bytes(4, "big")
    )


@pytest.fixture(scope="module")
def task(tiny_lm):
    return tiny_lm(2)


def test_bombs_cost_less_than_a_model_and_the_round_goes_on(rabbit_url, job_id, task, tmp_path):
    cfg = JobConfig(
        job=job_id,
        strategy="fedavg",
        rounds=1,
        clients=2,
        fraction=1.0,
        lr=5.0,
        max_steps=2,
        batch_size=4,
        heartbeat_s=60,
        join_timeout_s=60,
        report_deadline_s=60,
        update_deadline_s=60,
        identity="shared:guest",
        encoding="raw",
        down_encoding="raw",
    )
    pub = connect(rabbit_url)
    pub.declare_job(job_id, list(AGENTS))  # the agents' queues, so round 1's announces are routable
    engine = Engine(connect(rabbit_url), task, cfg, tmp_path / "run", durable=False, evaluate=False)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(engine.run()), daemon=True)
    runner.start()
    agents: list[Agent] = []
    threads: list[threading.Thread] = []
    try:
        for a in AGENTS:
            env = messages.presence(job_id, a, "online", -1)
            pub.publish(topology.rk_presence(job_id, a), messages.encode(env), message_id=env.msg_id)
        deadline = time.monotonic() + budget(30)
        while engine.phase != "training" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.phase == "training" and engine.round == 1

        state = {k: v.detach().float() for k, v in model_state(task.build_model(0)).items()}
        tensors = encode_state(state, EncodingSpec.parse("raw"))
        plane = tensors["t"][0]["p"][0]  # [codec, size, data]: swap in a frame declaring INFLATED bytes
        tensors["t"][0]["p"][0] = [1, plane[1], _zeros_frame(b"", INFLATED, declare=True)]
        # from agent-0, the first in the round's fold order: it is decoded (and rejected) at once; a later
        # client's update waits, unacked and undecoded, for its turn (engine._fold_in_order),
        # which costs no memory either
        blob_bomb = messages.encode(messages.update(job_id, 1, "agent-0", 0, 1.0, 10, tensors), level=0)
        bombs = {
            "envelope declaring 256 MiB": _wire(
                _zeros_frame(_update_prefix(job_id, "agent-0"), INFLATED, declare=True), FLAG_ZSTD
            ),
            "envelope of unknown size": _wire(
                _zeros_frame(_update_prefix(job_id, "agent-0"), INFLATED, declare=False), FLAG_ZSTD
            ),
            "tensor plane declaring 256 MiB": blob_bomb,
        }
        model_bytes = engine.manifest.message_bound
        for name, body in bombs.items():
            assert len(body) < 1 << 20, name  # small on the wire
            n = engine.inbox.rejected["bomb"]
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
            rss0 = _status_kib("VmRSS")
            pub.publish(topology.rk_update(job_id, "agent-0"), body)
            deadline = time.monotonic() + budget(10)
            while engine.inbox.rejected["bomb"] == n and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.inbox.rejected["bomb"] == n + 1, (name, dict(engine.inbox.rejected))
            grew = (_status_kib("VmHWM") - rss0) << 10
            print(f"{name}: {len(body)} bytes on the wire, peak RSS +{grew / 2**20:.1f} MiB")
            assert grew < model_bytes + SLACK, f"{name}: peak RSS grew by {grew >> 20} MiB"
            assert runner.is_alive()
        assert engine.version == 0 and engine.round == 1 and not engine.inbox.dropped

        # an operator finds the rejected bombs in the job's dead-letter queue
        deadline = time.monotonic() + budget(5)
        while pub.queue_depth(topology.q_dead(job_id)) < len(bombs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pub.queue_depth(topology.q_dead(job_id)) == len(bombs)

        # the round goes on: the real agents train and upload, and exactly their two updates are folded
        for i, a in enumerate(AGENTS):
            agents.append(
                Agent(lambda: connect(rabbit_url), job_id, a, i, task, heartbeat_s=60, rejoin_s=0.2)
            )
        threads = [threading.Thread(target=ag.run, daemon=True) for ag in agents]
        for t in threads:
            t.start()
        runner.join(timeout=budget(60))
        assert not runner.is_alive() and result["rounds_completed"] == 1
        uploads = sorted(u for ag in agents for (r, u) in ag.log.uploads if r == 1)
        assert sorted(engine.folded[1]) == uploads and len(uploads) == 2
    finally:
        engine.stop.set()
        for ag in agents:
            ag.stop.set()
        for t in threads:
            t.join(timeout=budget(10))
        runner.join(timeout=budget(10))
        pub.close()
        purge(rabbit_url, job_id, list(AGENTS))


def test_incomplete_chunked_updates_are_bounded_by_the_manifest(rabbit_url, job_id, task, tmp_path):
    """One sender leaves chunked messages incomplete (all chunks but the last): the aggregator holds at most
    two update-sized messages of that sender, refuses a message larger than an update at its first chunk, and
    the refused chunks wait in the dead-letter queue. (Before: up to 4 GiB per consumer, for 300 s.)"""
    cfg = JobConfig(
        job=job_id,
        rounds=1,
        clients=2,
        fraction=1.0,
        heartbeat_s=60,
        join_timeout_s=60,
        identity="shared:guest",
    )
    pub = connect(rabbit_url)
    pub.declare_job(job_id, list(AGENTS))
    engine = Engine(connect(rabbit_url), task, cfg, tmp_path / "run", durable=False, evaluate=False)
    runner = threading.Thread(target=engine.run, daemon=True)
    runner.start()
    try:
        limit = engine.inbox.limits.max_message_bytes  # one update message, from the manifest
        deadline = time.monotonic() + budget(10)
        while engine._consumer is None and time.monotonic() < deadline:
            time.sleep(0.05)
        gate = engine.broker._consumers.by_tag[engine._consumer].gate
        rk = topology.rk_update(job_id, "agent-0")
        sent = 0
        for i in range(3):  # three nearly update-sized messages, each missing its last chunk
            parts = split(os.urandom(limit - 4096), f"partial-{i}", 64 << 10)
            for c in parts[:-1]:
                pub.publish(rk, encode_chunk(c), headers={CHUNK_HEADER: 1})
                sent += 1
        huge = split(os.urandom(1 << 20), "huge", 64 << 10)[0]  # first chunk of a message declaring 64 MiB
        pub.publish(
            rk, encode_chunk(replace(huge, total=1024, total_size=64 << 20)), headers={CHUNK_HEADER: 1}
        )
        refused = len(parts) - 1 + 1  # every chunk of the third message, and the huge one
        deadline = time.monotonic() + budget(10)
        while gate.rejected < refused and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gate.rejected == refused
        assert gate.reassembler.pending_messages() == 2
        assert gate.reassembler.pending_bytes() == 2 * (limit - 4096) <= 2 * limit
        deadline = time.monotonic() + budget(5)
        while pub.queue_depth(topology.q_dead(job_id)) < refused and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pub.queue_depth(topology.q_dead(job_id)) == refused
        assert runner.is_alive() and engine.version == 0
    finally:
        engine.stop.set()
        runner.join(timeout=budget(10))
        pub.close()
        purge(rabbit_url, job_id, list(AGENTS))
