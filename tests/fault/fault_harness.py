"""A real federation in separate processes (`fedmq aggregator run`, `fedmq agent run`), faults, and the audit.

Used by the fault suite (tests/fault); docs/reliability.md has the commands for repeated (full) runs.
Every agent runs with ``--audit-log`` (one JSON line per broker-confirmed upload); the audit compares them
with what the aggregator folded (the newest checkpoint's ``folded``: round -> update ids) and with the updates
it dropped on purpose (logged with their msg id), so an update can be: folded once (good), folded twice
(duplicated), confirmed but neither folded nor dropped (lost), or folded but never confirmed (an agent killed
between the broker's confirm and its log line: harmless, reported as ``unconfirmed_folded``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fedmq_procs
from load_factor import budget

from fedmq.aggregator.runlog import read_rounds
from fedmq.aggregator.spool import RoundSpool

ROOT = Path(__file__).resolve().parents[2]
FEDMQ = str(Path(sys.executable).parent / "fedmq")

# the tiny language model of tests/integration/test_federation.py: a round takes well under a second
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


def read_jsonl(path: Path) -> list[Any]:
    """The JSON values of a JSON-lines log (missing file: none); a line that is not JSON
    (a traceback) is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))


def write_config(path: Path, job: dict[str, Any], task: dict[str, Any]) -> Path:
    """A job file: JobConfig keys at the top, a table for each dict among them (``strategy``), then [task]."""
    tables = {k: v for k, v in job.items() if isinstance(v, dict)}
    lines = [f"{k} = {_toml_value(v)}" for k, v in job.items() if k not in tables]
    for name, table in {**tables, "task": task}.items():
        lines += ["", f"[{name}]", *(f"{k} = {_toml_value(v)}" for k, v in table.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def wait_for(pred: Callable[[], bool], timeout: float, what: str, poll: float = 0.05) -> None:
    """Poll ``pred`` until it holds; an error after ``timeout`` (an idle machine's seconds, scaled by
    tests/load_factor.py)."""
    timeout = budget(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def delete_job_queues(url: str, job: str, clients: int, hosts: int = 0, edges: int = 0) -> None:
    """Remove the job's queues from a broker (tests on the shared broker leave nothing behind)."""
    import pika

    from fedmq.broker.transport import topology as t

    try:
        conn = pika.BlockingConnection(pika.URLParameters(url))
    except Exception:  # the broker may be down in a failed test; nothing to clean then
        return
    try:
        ch = conn.channel()
        names = [t.q_inbox(job), t.q_dead(job), t.q_models(job)]
        owners = [f"h{h}" for h in range(hosts)] or [f"agent-{i}" for i in range(clients)]
        names += [q for o in owners for q in (t.q_latest(job, o), t.q_control(job, o))]
        names += [t.q_edge(job, e) for e in range(edges)]
        for name in names:
            ch.queue_delete(name)
    finally:
        conn.close()


@dataclass
class Audit:
    rounds_completed: int
    rounds_skipped: int
    confirmed: int
    folded: int
    lost: list[tuple[int, str]]
    duplicated: list[str]
    unconfirmed_folded: list[tuple[int, str]]
    dropped: list[tuple[int, str, str]]  # (round, msg id, reason) of confirmed uploads dropped on purpose
    max_round_s: float
    finite: bool
    shapes_ok: bool

    @property
    def clean(self) -> bool:
        return not self.lost and not self.duplicated and self.finite and self.shapes_ok

    def as_dict(self) -> dict[str, Any]:
        return {k: (len(v) if isinstance(v, list) else v) for k, v in self.__dict__.items()}


@dataclass
class Federation:
    """A job with ``clients`` agent processes and one or more aggregator processes sharing ``base/state``."""

    base: Path
    url: str
    job: str
    clients: int = 3
    rounds: int = 4
    job_options: dict[str, Any] = field(default_factory=dict)
    agent_faults: dict[int, str] = field(default_factory=dict)
    agent_url: Callable[[int], str] | None = None  # per-agent broker URL (e.g. through a TCP proxy)
    agent_env: dict[str, str] = field(
        default_factory=dict
    )  # e.g. FEDMQ_CHUNK_LIMIT / FEDMQ_HEARTBEAT for agents
    task: dict[str, Any] = field(default_factory=lambda: dict(TINY_TASK))  # the job file's [task] table
    hosts: int = 0  # > 0: the clients are served by this many host processes (h0, h1, …), not one each
    edges: int = 0  # > 0: two-tier aggregation, with this many edge aggregator processes (edge-0, …)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    restarts: int = 0

    def __post_init__(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self.state = self.base / "state"
        self.audit_dir = self.base / "audit"
        self.logs = self.base / "logs"
        for d in (self.audit_dir, self.logs):
            d.mkdir(exist_ok=True)
        job = {
            "job": self.job,
            "strategy": "fedavg",
            "rounds": self.rounds,
            "clients": self.clients,
            "fraction": 1.0,
            "lr": 5.0,
            "max_steps": 3,
            "batch_size": 4,
            "heartbeat_s": 2.0,
            "join_timeout_s": 90.0,
            "report_deadline_s": 20.0,
            "update_deadline_s": 20.0,
            "identity": f"shared:{self._url_user()}",
            # raw: the kill-mid-upload faults need updates of several socket writes
            "encoding": "raw",
            "down_encoding": "raw",
            **({"edges": self.edges} if self.edges else {}),
            **self.job_options,
        }
        self.cfg = job
        self.config = write_config(self.base / "job.toml", job, {**self.task, "clients": self.clients})

    def _url_user(self) -> str:
        from urllib.parse import urlsplit

        return urlsplit(self.url).username or "guest"

    @staticmethod
    def _env() -> dict[str, str]:
        return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def _spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        out = open(self.logs / f"{name}.out", "ab")
        err = open(self.logs / f"{name}.err", "ab")
        proc = fedmq_procs.popen(
            [FEDMQ, *args],
            stdout=out,
            stderr=err,
            env={**self._env(), **(extra_env or {})},
            cwd=self.base,
            start_new_session=True,
        )
        self.procs[name] = proc
        return proc

    def start_aggregator(self, name: str = "agg") -> subprocess.Popen:
        # the same chunk limit as the agents (the aggregator sizes its prefetch from it: every chunk of the
        # round) and the same consume timeout
        env = {k: v for k, v in self.agent_env.items() if k in ("FEDMQ_CHUNK_LIMIT", "FEDMQ_CONSUME_TIMEOUT")}
        return self._spawn(
            name,
            [
                "aggregator",
                "run",
                "--broker",
                self.url,
                "--config",
                str(self.config),
                "--state-dir",
                str(self.state),
                "--log-level",
                "info",
            ],
            env,
        )

    def start_edge(self, e: int, name: str | None = None) -> subprocess.Popen:
        """Edge aggregator ``e`` (`aggregator run --tier edge`), sharing the root's state dir."""
        args = ["aggregator", "run", "--tier", "edge", "--edge", str(e), "--broker", self.url]
        args += ["--config", str(self.config), "--state-dir", str(self.state), "--log-level", "info"]
        return self._spawn(name or f"edge-{e}", args)

    def start_agent(self, i: int) -> subprocess.Popen:
        url = self.agent_url(i) if self.agent_url else self.url
        args = [
            "agent",
            "run",
            "--broker",
            url,
            "--job",
            self.job,
            "--client-id",
            f"agent-{i}",
            "--config",
            str(self.config),
            "--device",
            "cpu",
            "--audit-log",
            str(self.audit_dir / f"agent-{i}.jsonl"),
            "--log-level",
            "info",
        ]
        if self.agent_faults.get(i):
            args += ["--faults", self.agent_faults[i]]
        return self._spawn(f"agent-{i}", args, self.agent_env)

    def start_host(self, h: int) -> subprocess.Popen:
        """Host h{h}, serving its share of the clients (``agent_faults[h]`` applies to all of them)."""
        per = -(-self.clients // self.hosts)
        lo, hi = h * per, min((h + 1) * per, self.clients)
        args = [
            "agent",
            "run",
            "--broker",
            self.url,
            "--job",
            self.job,
            "--host",
            f"h{h}",
            "--clients",
            f"{lo}-{hi - 1}",
            "--config",
            str(self.config),
            "--device",
            "cpu",
            "--audit-log",
            str(self.audit_dir / f"host-h{h}.jsonl"),
            "--log-level",
            "info",
        ]
        if self.agent_faults.get(h):
            args += ["--faults", self.agent_faults[h]]
        return self._spawn(f"host-h{h}", args, self.agent_env)

    def start(self) -> Federation:
        self.start_aggregator()
        for e in range(self.edges):
            self.start_edge(e)
        for i in range(self.hosts or self.clients):
            (self.start_host if self.hosts else self.start_agent)(i)
        return self

    def kill9(self, name: str) -> None:
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=budget(10))

    def wait_aggregator(self, name: str = "agg", timeout: float = 120.0) -> dict[str, Any]:
        """Wait for an aggregator to finish the job (``timeout``: an idle machine's seconds); its summary
        (the JSON line it prints)."""
        proc, timeout = self.procs[name], budget(timeout)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"aggregator {name} did not finish in {timeout:.0f}s; logs in {self.logs}"
            ) from None
        out = (self.logs / f"{name}.out").read_text().strip().splitlines()
        if proc.returncode != 0 or not out:
            err = (self.logs / f"{name}.err").read_text()[-3000:]
            raise AssertionError(f"aggregator {name} exited with {proc.returncode}:\n{err}")
        return json.loads(out[-1])

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        deadline = time.monotonic() + budget(15)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=budget(10))

    # ------------------------------------------------------------------ observing the aggregator
    def rows(self) -> list[dict[str, Any]]:
        return [r.to_json() for r in read_rounds(self.state).records]

    def spooled_updates(self, rnd: int) -> int:
        return len(list((self.state / "spool" / f"r{rnd:06d}").glob("update-*.msg")))

    def round_open(self, rnd: int) -> bool:
        return (self.state / "spool" / f"r{rnd:06d}" / "round.json").is_file()

    def round_state(self, rnd: int) -> dict[str, Any]:
        """The open round's facts in the spool (selected, reported, granted), as a restart would read them;
        {} before it opens or after it closed."""
        try:
            return RoundSpool(self.state / "spool").load(rnd)[0] or {}
        except (OSError, ValueError):
            return {}

    def round_closed(self, rnd: int) -> bool:
        return any(r.get("round") == rnd for r in self.rows())

    def agent_events(self, i: int, event: str, rnd: int | None = None) -> list[dict[str, Any]]:
        """JSON log lines of agent-i (its stderr, all its incarnations) with this event (and round)."""
        return [
            r
            for r in read_jsonl(self.logs / f"agent-{i}.err")
            if r.get("event") == event and (rnd is None or r.get("round") == rnd)
        ]

    def agg_events(self, event: str) -> list[dict[str, Any]]:
        return [r for r in read_jsonl(self.state / "logs" / "aggregator.jsonl") if r.get("event") == event]

    # ------------------------------------------------------------------ the audit
    def confirmed(self) -> set[tuple[int, str]]:
        found = set()
        for p in self.audit_dir.glob("*.jsonl"):
            for line in p.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    found.add((int(rec["round"]), rec["update_id"]))
        return found

    def audit(self, slack_s: float = 10.0) -> Audit:
        import torch

        from fedmq.aggregator.checkpoint import load_checkpoint
        from fedmq.tasks.base import model_state
        from fedmq.tasks.lm import LanguageModelTask

        ckpt = load_checkpoint(self.state / "checkpoints")
        assert ckpt is not None, "no checkpoint written"
        folded_pairs = [(r, u) for r, ids in ckpt.folded.items() for u in ids]
        ids = [u for _, u in folded_pairs]
        duplicated = sorted({u for u in ids if ids.count(u) > 1})
        confirmed = self.confirmed()
        folded_set = set(folded_pairs)
        # a redelivery of an update already folded (the aggregator died between spooling it and acking it) is
        # dropped as a duplicate: that is the guarantee working, not a drop
        folded_ids = set(ids)
        dropped = [
            (e.get("round", -1), e["msg_id"], e["reason"])
            for e in self.agg_events("message dropped")
            if e.get("kind") == "update"
            and e.get("msg_id")
            and not (e["reason"] == "duplicate" and e["msg_id"] in folded_ids)
        ]
        dropped_ids = {m for _, m, _ in dropped}
        lost = sorted(c for c in confirmed if c not in folded_set and c[1] not in dropped_ids)
        unconfirmed = sorted(p for p in folded_set if p not in confirmed)
        rows = self.rows()
        task = LanguageModelTask(**{k: v for k, v in TINY_TASK.items() if k != "task"}, clients=self.clients)
        shapes = {k: tuple(v.shape) for k, v in model_state(task.build_model(0)).items()}
        state = ckpt.global_state
        return Audit(
            rounds_completed=sum(1 for r in rows if not r["skipped"]),
            rounds_skipped=sum(1 for r in rows if r["skipped"]),
            confirmed=len(confirmed),
            folded=len(ids),
            lost=lost,
            duplicated=duplicated,
            unconfirmed_folded=unconfirmed,
            dropped=[d for d in dropped if d[1] in {c[1] for c in confirmed}],
            max_round_s=max((r["wall_s"] for r in rows), default=0.0),
            finite=all(bool(torch.isfinite(v).all()) for v in state.values()),
            shapes_ok={k: tuple(v.shape) for k, v in state.items()} == shapes,
        )

    def round_limit_s(self, slack_s: float = 10.0) -> float:
        """The longest a round may take: report + update deadlines, plus slack for evaluation and startup
        (an idle machine's seconds, scaled by tests/load_factor.py)."""
        return float(self.cfg["report_deadline_s"]) + float(self.cfg["update_deadline_s"]) + budget(slack_s)


class TcpProxy:
    """A TCP proxy between agents and the broker that can cut (RST),
    stall or throttle every connection through it."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.stalled = threading.Event()
        self.refusing = threading.Event()
        self.upstream_rate: float | None = None  # bytes/s client -> broker (None: unthrottled)
        self.upstream_bytes = 0  # bytes forwarded client -> broker so far
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            if self.refusing.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pipe, args=(a, b, up), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, up: bool = False) -> None:
        try:
            while True:
                rate = self.upstream_rate if up else None
                data = src.recv(4096 if rate else 65536)
                if not data:
                    while self.stalled.is_set():  # a stalled link forwards nothing, not even a close
                        time.sleep(0.05)
                    break
                while self.stalled.is_set():
                    time.sleep(0.05)
                if rate:
                    time.sleep(len(data) / rate)
                dst.sendall(data)
                if up:
                    self.upstream_bytes += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def cut(self) -> None:
        """Reset every open connection (the peers see a dead TCP connection)."""
        import struct

        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            except OSError:
                pass
        self.cuts += 1

    def close(self) -> None:
        self.sock.close()
        self.cut()
