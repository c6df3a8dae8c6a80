"""The client agent: join a job, take the newest global model, train, report, upload when granted, repeat.

Threads: the broker's own I/O thread keeps the connection (and its heartbeats) alive; the broker's dispatcher
thread only queues deliveries here; the agent thread trains; a presence thread announces the agent while it
is online. Going offline (availability model or fault) closes the connection for real.
"""

from __future__ import annotations

import json
import os
import queue
import random
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import structlog
import torch

from broker import messages, topology
from broker.base import Broker, Delivery
from broker.encodings import EncodingSpec, decode_state, encode_state
from broker.envelope import Envelope, Kind
from broker.errors import BrokerError, CodecError
from client_agent.availability import Availability, Faults
from client_agent.pulling import STRATEGY_RULES, select_tensors
from client_agent.tasks.base import Task, TrainConfig, load_state, model_state

log = structlog.get_logger(__name__)

Connect = Callable[[], Broker]


def stable_seed(*parts: object) -> int:
    """A seed derived from values, identical in every process (unlike hash() of strings)."""
    return zlib.crc32("/".join(map(str, parts)).encode())


@dataclass
class AgentLog:
    """What the agent did, for tests and the fault-suite audit: confirmed uploads per round."""

    uploads: list[tuple[int, str]] = field(default_factory=list)  # (round, update msg id), after the broker confirmed
    rounds_trained: list[int] = field(default_factory=list)
    offline_rounds: list[int] = field(default_factory=list)
    faults: list[tuple[int, str]] = field(default_factory=list)
    sent: dict[int, tuple[int, dict]] | None = None  # round -> (n_samples, tensors sent); kept only when asked (tests)


class Offline(Exception):
    """Raised inside the agent loop to leave the broker (availability model or injected fault)."""

    def __init__(self, why: str, graceful: bool) -> None:
        super().__init__(why)
        self.graceful = graceful


class Agent:
    def __init__(self, connect: Connect, job: str, client: str, index: int, task: Task, *,
                 availability: Availability | None = None, faults: Faults | None = None, device: str = "cpu",
                 heartbeat_s: float = 5.0, rejoin_s: float = 2.0, seed: int = 0,
                 train_lock: threading.Semaphore | None = None, audit_log: str | Path | None = None,
                 progress: Callable[[str, int, int], None] | None = None) -> None:
        self.connect, self.job, self.client, self.index, self.task = connect, job, client, index, task
        self.availability = availability or Availability()
        self.faults = faults or Faults()
        self.device, self.heartbeat_s, self.rejoin_s, self.seed = device, heartbeat_s, rejoin_s, seed
        self.train_lock = train_lock
        self.progress = progress  # (client, steps done, steps total) during local training, for progress bars
        self.audit_log = Path(audit_log) if audit_log else None  # JSON lines: one per broker-confirmed upload
        self.stop = threading.Event()
        self.model = task.build_model(seed)
        self.manifest = task.manifest(self.model)
        self.groups = task.groups()
        self.version = messages.NO_VERSION
        self.held: dict[str, torch.Tensor] | None = None  # the newest global model we hold
        self.previous_own: dict[str, torch.Tensor] | None = None  # our own model after the previous local run
        self.last_round = 0
        self.log = AgentLog()
        self._events: "queue.Queue[Delivery]" = queue.Queue()
        self._broker: Broker | None = None

    @property
    def connected(self) -> bool:
        """Joined the job (for /readyz): False while offline, reconnecting or stopped."""
        return self._broker is not None

    # ------------------------------------------------------------------ connection
    def _join(self) -> Broker:
        delay = 0.2
        while not self.stop.is_set():
            broker = None
            try:
                broker = self.connect()
                broker.declare_job(self.job, [self.client], inbox=False, model_bytes=self.manifest.message_bound)
                self._events = queue.Queue()
                broker.consume(topology.q_latest(self.job, self.client), self._events.put, prefetch=1)
                broker.consume(topology.q_control(self.job, self.client), self._events.put, prefetch=16)
                self._broker = broker
                self._presence("online")
                return broker
            except BrokerError as exc:
                # close the half-joined connection: its consumers would otherwise take (and lose) our deliveries
                if broker is not None:
                    try:
                        broker.close()
                    except Exception as close_exc:  # already broken: nothing more to release
                        log.debug("closing a failed join", error=str(close_exc))
                log.warning("cannot join, retrying", client=self.client, error=str(exc), delay=delay)
                self.stop.wait(delay)
                delay = min(delay * 2, 10.0)
        raise Offline("stopped", True)

    def _leave(self, graceful: bool) -> None:
        broker, self._broker = self._broker, None
        if broker is None:
            return
        if graceful:
            try:
                self._presence("offline", broker)
            except BrokerError:
                pass
        broker.close()

    def _presence(self, state: str, broker: Broker | None = None) -> None:
        broker = broker or self._broker
        if broker is None:
            return
        env = messages.presence(self.job, self.client, state, self.version)
        broker.publish(topology.rk_presence(self.job, self.client), messages.encode(env), message_id=env.msg_id)

    def _heartbeats(self) -> None:
        while not self.stop.wait(self.heartbeat_s):
            try:
                self._presence("online")
            except (BrokerError, AttributeError):
                pass

    # ------------------------------------------------------------------ main loop
    def run(self) -> AgentLog:
        beat = threading.Thread(target=self._heartbeats, name=f"{self.client}-presence", daemon=True)
        beat.start()
        while not self.stop.is_set():
            try:
                self._join()
                self._serve()
            except Offline as off:
                self._leave(off.graceful)
                if not self.stop.is_set():
                    log.info("agent offline", client=self.client, why=str(off))
                    self.stop.wait(self.rejoin_s)
            except BrokerError as exc:  # connection lost for good: drop it and join again
                log.warning("broker connection lost", client=self.client, error=str(exc))
                self._leave(False)
                self.stop.wait(self.rejoin_s)
        self._leave(True)
        return self.log

    def _serve(self) -> None:
        while not self.stop.is_set():
            env = self._next(timeout=0.5)
            if env is not None and env.kind is Kind.ANNOUNCE:
                self._on_announce(env)

    def _next(self, timeout: float) -> Envelope | None:
        try:
            delivery = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        broker = self._broker
        try:
            env = messages.decode(delivery.body)
            if env.job != self.job or env.kind not in (Kind.ANNOUNCE, Kind.GRANT):
                raise CodecError("unexpected", f"{env.kind.value} for job {env.job}")
        except CodecError as exc:
            log.warning("message rejected", client=self.client, reason=exc.reason)
            if broker:
                broker.reject(delivery, requeue=False)
            return None
        if env.kind is Kind.ANNOUNCE:
            env = self._take_model(env)
        if broker:
            broker.ack(delivery)
        return env

    def _take_model(self, env: Envelope) -> Envelope | None:
        """Decode the announced global model (full, or a delta against the version we hold)."""
        if env.model_version == self.version and self.held is not None:
            return env
        base_version = env.payload["base_version"]
        if base_version != messages.NO_VERSION and base_version != self.version:
            log.info("delta for a model we do not hold; waiting for a full one", client=self.client)
            return None
        try:
            state = decode_state(env.payload["tensors"], self.manifest, self.held if base_version >= 0 else None)
        except CodecError as exc:
            log.warning("global model rejected", client=self.client, reason=exc.reason)
            return None
        pushed = {k: torch.from_numpy(v) for k, v in state.items()}
        if len(pushed) < len(self.manifest):  # dynamic pulling downwards: keep our own values for the rest
            own = self.previous_own if self.previous_own is not None else self.held
            if own is None:
                log.info("partial model but we hold none; waiting for a full one", client=self.client)
                return None
            pushed = {k: pushed.get(k, own[k]) for k in self.manifest.names}
        self.held = pushed
        self.version = env.model_version
        return env

    # ------------------------------------------------------------------ one round
    def _on_announce(self, env: Envelope) -> None:
        rnd, payload = env.round, env.payload
        sync = payload["mode"] == "sync"
        if sync and (rnd <= self.last_round or self.client not in payload["selected"]):
            return
        if not self.availability.online(self.client, rnd if sync else env.model_version):
            self.log.offline_rounds.append(rnd)
            raise Offline(f"availability model: offline in slot {rnd}", True)
        self.last_round = rnd
        cfg = payload["config"]
        faults = self.faults.draw(self.client, rnd)
        log.info("round training", client=self.client, round=rnd, version=env.model_version)
        if "cut" in faults:
            self.log.faults.append((rnd, "cut"))
            raise Offline("fault: connection cut", False)
        result = self._train(cfg, rnd, crash="crash-train" in faults)
        if "slow" in faults:
            self.log.faults.append((rnd, "slow"))
            time.sleep(self.faults.slow_seconds)
        version = env.model_version
        self._send(messages.report(self.job, rnd, self.client, version, result.loss, result.n_samples),
                   topology.rk_report(self.job, self.client))
        if sync and cfg["grant"] and not self._wait_grant(rnd):
            return
        if "crash-grant" in faults:
            self.log.faults.append((rnd, "crash-grant"))
            raise Offline("fault: crashed after the grant", False)
        self._upload(cfg, rnd, version, result)

    def _train(self, cfg: dict[str, Any], rnd: int, crash: bool):
        load_state(self.model, self.held)
        tcfg = TrainConfig(epochs=cfg["epochs"], batch_size=cfg["batch_size"], lr=cfg["lr"],
                           optimizer=cfg["optimizer"], momentum=cfg["momentum"], lr_decay=cfg["lr_decay"],
                           clip=cfg["clip"], max_steps=cfg["max_steps"], device=self.device,
                           seed=stable_seed(cfg["seed"], self.client, rnd))
        if crash:
            self.log.faults.append((rnd, "crash-train"))
            raise Offline("fault: crashed during training", False)
        lock = self.train_lock
        if lock:
            lock.acquire()
        try:
            report = (lambda done, total: self.progress(self.client, done, total)) if self.progress else None
            result = self.task.train(self.model, self.index, tcfg, progress=report)
        finally:
            if lock:
                lock.release()
        self.log.rounds_trained.append(rnd)
        return result

    def _wait_grant(self, rnd: int) -> bool:
        """Wait for this round's grant; a newer announce means the round closed without us."""
        while not self.stop.is_set():
            env = self._next(timeout=0.5)
            if env is None:
                continue
            if env.kind is Kind.GRANT and env.round == rnd:
                return self.client in env.payload["granted"]
            if env.kind is Kind.ANNOUNCE and env.round > rnd:
                self._on_announce(env)  # our round closed without us; take part in the new one
                return False
        return False

    def _upload(self, cfg: dict[str, Any], rnd: int, version: int, result) -> None:
        current = {k: v.detach().clone() for k, v in model_state(self.model).items()}
        if cfg["noise"] > 0:  # FedAtt Eq. 6 randomization, seeded per (client, round)
            gen = torch.Generator().manual_seed(stable_seed(cfg["seed"], self.client, rnd, "noise"))
            current = {k: v + cfg["noise"] * torch.randn(v.shape, generator=gen) for k, v in current.items()}
        names = list(current)
        if cfg["pull"] != "all":
            names = select_tensors(current, self.previous_own, self.groups, STRATEGY_RULES[cfg["pull"]], cfg["pull_fraction"],
                                   random.Random(stable_seed(cfg["seed"], self.client, rnd, "pull")))
        self.previous_own = current
        spec = EncodingSpec.parse(cfg["encoding"])
        tensors = encode_state({k: current[k] for k in names}, spec, self.held if spec.delta else None)
        env = messages.update(self.job, rnd, self.client, version, result.loss, result.n_samples, tensors)
        body = messages.encode(env)
        # the fault suite watches these two lines to kill an agent mid-upload (see tests/fault/fault_plan.py)
        log.info("uploading update", client=self.client, round=rnd, msg_id=env.msg_id, bytes=len(body))
        self._publish(body, env.msg_id, topology.rk_update(self.job, self.client))
        log.info("update confirmed", client=self.client, round=rnd, msg_id=env.msg_id)
        self.log.uploads.append((rnd, env.msg_id))
        self._audit(rnd, env.msg_id, version)
        if self.log.sent is not None:
            self.log.sent[rnd] = (result.n_samples, {k: current[k].clone() for k in names})

    def _audit(self, rnd: int, update_id: str, version: int) -> None:
        """Append one confirmed upload to the audit log (flushed: a kill -9 right after cannot lose it)."""
        if self.audit_log is None:
            return
        line = json.dumps({"client": self.client, "round": rnd, "update_id": update_id, "model_version": version,
                           "time": time.time()})
        with open(self.audit_log, "a") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _send(self, env: Envelope, routing_key: str) -> None:
        self._publish(messages.encode(env), env.msg_id, routing_key)

    def _publish(self, body: bytes, msg_id: str, routing_key: str) -> None:
        broker = self._broker
        if broker is None:
            raise Offline("not connected", False)
        broker.publish(routing_key, body, message_id=msg_id)
