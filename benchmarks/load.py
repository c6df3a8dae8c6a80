"""`fedmq bench load`: N lightweight agents over RabbitMQ against a real `fedmq aggregator run` process.

The aggregator is the real service (a subprocess, tiny GRU language model, FedAvg, C = 1: every agent is
selected every round). The agents are a *swarm* in this process: a few pika connections, each speaking for
N/threads client ids. A swarm agent does not train: on each announce it uploads the announced global plus a
little seeded noise (a synthetic update with the manifest's names and shapes),
so the load is the protocol's, not the CPU's.

Measured: folded updates per second (over the rounds' wall time), p50/p99 from an agent's broker-confirmed
upload to the aggregator's round close (the moment the new global model that includes it exists), the
aggregator's peak RSS and CPU seconds (psutil on its process), the inbox's peak depth, and lost updates
(confirmed uploads missing from the checkpoint's folded ids) and duplicated ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from fedmq.benchmarks import markdown

log = structlog.get_logger(__name__)

TINY_TASK = {
    "task": "lm",
    "data": "builtin",
    "model": "gru-small",
    "emb": 16,
    "hidden": 16,
    "vocab_size": 500,
    "max_lines": 600,
    "max_eval_lines": 100,
    "bptt": 10,
    "dropout": 0.0,
}


def _toml(job: dict[str, Any], task: dict[str, Any]) -> str:
    def val(v: Any) -> str:
        return (
            ("true" if v else "false")
            if isinstance(v, bool)
            else repr(v)
            if isinstance(v, (int, float))
            else json.dumps(v)
        )

    return (
        "\n".join(
            [
                *(f"{k} = {val(v)}" for k, v in job.items()),
                "",
                "[task]",
                *(f"{k} = {val(v)}" for k, v in task.items()),
            ]
        )
        + "\n"
    )


@dataclass
class Swarm:
    """``clients`` agents sharing ``threads`` connections; records confirmed uploads (client, round,
    id, time)."""

    url: str
    job: str
    clients: list[str]
    threads: int = 4
    uploads: list[tuple[str, int, str, float]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run_group(self, group: list[str], seed: int) -> None:
        import torch

        from fedmq.broker.transport import topology
        from fedmq.broker.transport.connect import connect
        from fedmq.broker.wire import messages
        from fedmq.broker.wire.encodings import EncodingSpec, decode_state, encode_state
        from fedmq.broker.wire.envelope import Kind
        from fedmq.tasks.lm import LanguageModelTask

        task = LanguageModelTask(clients=1, seed=0, **{k: v for k, v in TINY_TASK.items() if k != "task"})
        manifest = task.manifest(task.build_model(0))
        broker = connect(self.url)
        inbox: list = []
        cond = threading.Condition()
        queue_name = f"fedmq.{self.job}.swarm.{seed}"
        # one queue for the whole group: the global model is fanned out once per connection,
        # not once per agent
        ch_queue = self._declare_swarm_queue(queue_name)

        def on_announce(d) -> None:
            with cond:
                inbox.append(d)
                cond.notify()

        broker.consume(ch_queue, on_announce, prefetch=4)
        for c in group:
            env = messages.presence(self.job, c, "online", -1)
            broker.publish(topology.rk_presence(self.job, c), messages.encode(env), message_id=env.msg_id)
        gen = torch.Generator().manual_seed(seed)
        done_rounds: set[int] = set()
        last_beat = time.time()
        while not self.stop.is_set():
            with cond:
                cond.wait_for(lambda: inbox or self.stop.is_set(), timeout=1.0)
                batch, inbox[:] = list(inbox), []
            if time.time() - last_beat > 20:  # heartbeats keep the swarm online
                for c in group:
                    env = messages.presence(self.job, c, "online", -1)
                    broker.publish(
                        topology.rk_presence(self.job, c), messages.encode(env), message_id=env.msg_id
                    )
                last_beat = time.time()
            for d in batch:
                env = messages.decode(d.body)
                broker.ack(d)
                if env.kind is not Kind.ANNOUNCE or env.round in done_rounds:
                    continue
                done_rounds.add(env.round)
                selected = set(env.payload["selected"])
                if not selected & set(group):
                    continue
                full = next(e for e in env.payload["models"] if e["base_version"] < 0 and not e["partial"])
                model = broker.fetch(
                    topology.q_models(self.job), full["id"], offset=full["since"], timeout=60
                )
                state = decode_state(messages.decode(model.body).payload["tensors"], manifest, None)
                upd = {
                    k: torch.from_numpy(v) + 0.01 * torch.randn(v.shape, generator=gen)
                    for k, v in state.items()
                }
                tensors = encode_state(upd, EncodingSpec.parse("raw"))
                for c in group:
                    if c not in selected:
                        continue
                    u = messages.update(self.job, env.round, c, env.model_version, 1.0, 10, tensors)
                    broker.publish(topology.rk_update(self.job, c), messages.encode(u), message_id=u.msg_id)
                    self.uploads.append((c, env.round, u.msg_id, time.time()))
        broker.close()

    def _declare_swarm_queue(self, name: str) -> str:
        import pika

        from fedmq.broker.transport import topology

        conn = pika.BlockingConnection(pika.URLParameters(self.url))
        try:
            ch = conn.channel()
            exchange = topology.exchange(self.job)
            ch.exchange_declare(exchange, "topic", durable=True)
            ch.queue_declare(name, durable=False, auto_delete=False, arguments={"x-expires": 600_000})
            ch.queue_bind(name, exchange, topology.rk_global(self.job))
            # sync rounds announce per agent
            ch.queue_bind(name, exchange, f"job.{self.job}.announce.*")
        finally:
            conn.close()
        return name

    def start(self) -> list[threading.Thread]:
        groups = [self.clients[i :: self.threads] for i in range(self.threads)]
        ts = [
            threading.Thread(target=self.run_group, args=(g, i), daemon=True)
            for i, g in enumerate(groups)
            if g
        ]
        for t in ts:
            t.start()
        return ts


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def tiny_job(job: str, url: str, clients: int, rounds: int, **settings: Any) -> dict[str, Any]:
    """The job settings of a bench's FedAvg federation of the tiny language model over RabbitMQ (one local
    step a client, evaluated once at the end), with ``settings`` changed."""
    from fedmq.broker.transport.urls import url_user

    return {
        "job": job,
        "strategy": "fedavg",
        "rounds": rounds,
        "clients": clients,
        "fraction": 1.0,
        "lr": 1.0,
        "max_steps": 1,
        "heartbeat_s": 30.0,
        "join_timeout_s": 120.0,
        "report_deadline_s": 120.0,
        "update_deadline_s": 120.0,
        "identity": f"shared:{url_user(url) or 'guest'}",
        "eval_every": rounds,
        **settings,
    }


def one_thread_env() -> dict[str, str]:
    """This process's environment, with torch's (OpenMP's) threads held to one a process."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def fedmq_command(*args: str) -> list[str]:
    """The command line of this environment's ``fedmq`` with ``args``."""
    return [str(Path(sys.executable).parent / "fedmq"), *args]


def start_aggregator(url: str, work: Path, edge: int | None = None) -> subprocess.Popen:
    """``fedmq aggregator run`` of the job in ``work``/job.toml, its state and output in ``work``: the root,
    or with ``edge`` that edge aggregator (its output in e<edge>.out/.err)."""
    tier = () if edge is None else ("--tier", "edge", "--edge", str(edge))
    name = "agg" if edge is None else f"e{edge}"
    return subprocess.Popen(
        fedmq_command(
            "aggregator",
            "run",
            *tier,
            "--broker",
            url,
            "--config",
            str(work / "job.toml"),
            "--state-dir",
            str(work / "state"),
            "--log-level",
            "warning",
        ),
        stdout=open(work / f"{name}.out", "wb"),
        stderr=open(work / f"{name}.err", "wb"),
        env=one_thread_env(),
    )


def _watch(
    agg: subprocess.Popen, probe: Any, job: str, t0: float, timeout_s: float
) -> tuple[int, int, float]:
    """Sample the aggregator until it exits (or ``timeout_s`` after ``t0``, then kill it): its peak RSS, the
    inbox's peak depth and the CPU seconds it used."""
    import psutil

    from fedmq.broker.transport import topology

    proc = psutil.Process(agg.pid)
    peak_rss, peak_depth, cpu_s = 0, 0, float("nan")
    while agg.poll() is None and time.time() - t0 < timeout_s:
        try:
            peak_rss = max(peak_rss, proc.memory_info().rss)
            cpu = proc.cpu_times()
            cpu_s = cpu.user + cpu.system  # last sample before exit (the process is gone afterwards)
        except psutil.Error:
            break
        peak_depth = max(peak_depth, probe.queue_depth(topology.q_inbox(job)))
        time.sleep(0.2)
    if agg.poll() is None:
        agg.kill()
    agg.wait()
    return peak_rss, peak_depth, cpu_s


def _row(n: int, work: Path, swarm: Swarm, t0: float, watched: tuple[int, int, float]) -> dict[str, Any]:
    """The bench's row for ``n`` agents: what the aggregator's run folder and the swarm's confirmed uploads
    say (rounds, updates folded, their rate and latency, lost and duplicated updates) and what ``_watch``
    sampled."""
    from fedmq.aggregator.checkpoint import load_checkpoint
    from fedmq.aggregator.runlog import read_rounds

    metrics = read_rounds(work / "state").records
    if not metrics:
        err = (work / "agg.err").read_text(errors="replace").strip().splitlines()
        raise RuntimeError(f"the aggregator wrote no metrics: {err[-1] if err else 'no output'}")
    ckpt = load_checkpoint(work / "state" / "checkpoints")
    folded = [u for ids in (ckpt.folded.values() if ckpt else []) for u in ids]
    closed = {m.round: m.time for m in metrics}
    confirmed = {(r, u): t for _, r, u, t in swarm.uploads}
    folded_set = set(folded)
    lost = [k for k in confirmed if k[1] not in folded_set and k[0] in closed]
    lat = [closed[r] - t for (r, u), t in confirmed.items() if u in folded_set and r in closed]
    first = min((t for *_, t in swarm.uploads), default=t0)
    wall = (max(closed.values()) - first) if closed else float("nan")
    peak_rss, peak_depth, cpu_s = watched
    return {
        "agents": n,
        "rounds": len(metrics),
        "updates_folded": len(folded),
        "updates_per_s": len(folded) / wall if wall and wall == wall else float("nan"),
        "p50_s": _percentile(lat, 0.5),
        "p99_s": _percentile(lat, 0.99),
        "agg_peak_rss_mb": peak_rss / 2**20,
        "agg_cpu_s": cpu_s,
        "inbox_peak_depth": peak_depth,
        "lost": len(lost),
        "duplicated": len(folded) - len(folded_set),
        "wall_s": wall,
    }


def bench_load(
    url: str = "amqp://guest:guest@127.0.0.1:5672/%2F",
    agents: tuple[int, ...] = (100, 1000),
    rounds: int = 3,
    threads: int = 4,
    timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    from fedmq.broker.transport.connect import connect

    rows = []
    for n in agents:
        job = f"load-{uuid.uuid4().hex[:8]}"
        work = Path(tempfile.mkdtemp(prefix=f"fedmq-load-{n}-"))
        cfg = tiny_job(job, url, n, rounds)
        (work / "job.toml").write_text(_toml(cfg, {**TINY_TASK, "clients": min(n, 100)}))
        agg = start_aggregator(url, work)
        probe = connect(url)
        probe.declare_job(
            job, []
        )  # the inbox (idempotent: the aggregator declares the same), so presence routes
        swarm = Swarm(url, job, [f"agent-{i}" for i in range(n)], threads=threads)
        t0 = time.time()
        threads_ = swarm.start()
        watched = _watch(agg, probe, job, t0, timeout_s)
        swarm.stop.set()
        for t in threads_:
            t.join(timeout=10)
        rows.append(_row(n, work, swarm, t0, watched))
        log.info("load run", **rows[-1])
        _delete_queues(url, job, [f"fedmq.{job}.swarm.{i}" for i in range(threads)])
        probe.close()
    return rows


def _delete_queues(url: str, job: str, extra: list[str]) -> None:
    import pika

    from fedmq.broker.transport import topology

    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        for q in [topology.q_inbox(job), *extra]:
            ch.queue_delete(q)
    finally:
        conn.close()


def format_table(rows: list[dict[str, Any]]) -> str:
    cols = [
        "agents",
        "rounds",
        "updates_folded",
        "updates_per_s",
        "p50_s",
        "p99_s",
        "agg_peak_rss_mb",
        "agg_cpu_s",
        "inbox_peak_depth",
        "lost",
        "duplicated",
    ]
    return markdown.table(
        cols, [[f"{r[c]:.2f}" if isinstance(r[c], float) else r[c] for c in cols] for r in rows]
    )
