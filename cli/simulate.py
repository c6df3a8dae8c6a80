"""`fedmq simulate`: an aggregator and K agents in one process, over the in-process broker or RabbitMQ.

Simulated clients are light: every agent is a real broker client (its own connection, presence, queues), but
the models they train on come from one TrainerPool of ``trainers`` models, and what an algorithm keeps per
client between rounds lives on disk under the run folder (client_agent.state.DiskStore). Memory is then
O(trainers × model + selected clients' encoded updates), not O(K × model).
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import structlog

from aggregator.config import JobConfig
from aggregator.engine import Engine
from broker import topology
from broker.connect import connect
from client_agent.agent import Agent, AgentLog
from client_agent.availability import parse_availability, parse_faults
from client_agent.state import DiskStore
from client_agent.tasks.base import Task
from client_agent.trainers import TrainerPool

log = structlog.get_logger(__name__)
# The in-process broker moves references, not bytes: chunking a model there (as RabbitMQ's message size limit
# requires) would only copy it twice. Chunking is covered by the contract suite on both backends.
IN_PROCESS_CHUNK_LIMIT = 1 << 31
PRESENCE_PER_S = 50.0


@dataclass
class Simulation:
    cfg: JobConfig
    task: Task
    broker_url: str = "memory://sim"
    run_dir: Path = Path("runs/sim")
    availability: str = "always"
    faults: str = ""
    device: str = "cpu"
    resume: bool = False
    rejoin_s: float = 1.0
    trainers: int = 1  # models local training runs on (2 cores: one at a time keeps each one fast)
    on_round: Callable[[dict], None] | None = None
    on_local_progress: Callable[[str, int, int], None] | None = None
    agent_logs: dict[str, AgentLog] = field(default_factory=dict)
    engine: Engine | None = None

    def _url_user(self) -> str | None:
        if self.broker_url.startswith("memory://"):
            return None
        return urllib.parse.urlparse(self.broker_url).username or "guest"

    def run(self, stop: threading.Event | None = None) -> dict[str, Any]:
        cfg = self.cfg
        # presence costs every simulated agent a message per heartbeat: at most PRESENCE_PER_S of them a second
        # in all (K = 1,000: one heartbeat per agent every 20 s; absences are then noticed within 60 s)
        cfg.heartbeat_s = max(cfg.heartbeat_s, cfg.clients / PRESENCE_PER_S)
        shared_user = self._url_user()
        if shared_user:  # every agent shares the URL's account: check the user, not per-agent identity
            cfg.identity = f"shared:{shared_user}"
        availability = parse_availability(self.availability, cfg.seed)
        faults = parse_faults(self.faults, cfg.seed)
        memory = shared_user is None
        limit = {"chunk_limit": IN_PROCESS_CHUNK_LIMIT} if memory else {}
        agg_broker = connect(self.broker_url, user=topology.AGGREGATOR_USER if memory else None, **limit)
        self.engine = engine = Engine(agg_broker, self.task, cfg, self.run_dir, durable=shared_user is not None,
                                      on_round=self.on_round)
        pool = TrainerPool(self.task, self.trainers, cfg.seed)
        store = DiskStore(self.run_dir / "clients")
        agents, threads = [], []
        for i in range(cfg.clients):
            client = f"agent-{i}"
            agent = Agent(lambda c=client: connect(self.broker_url, user=c if memory else None, **limit), cfg.job, client, i, self.task,
                          availability=availability, faults=faults, device=self.device,
                          heartbeat_s=cfg.heartbeat_s, rejoin_s=self.rejoin_s, seed=cfg.seed, trainers=pool, store=store,
                          progress=self.on_local_progress)
            agents.append(agent)
            self.agent_logs[client] = agent.log
            threads.append(threading.Thread(target=agent.run, name=client, daemon=True))
        watcher = None
        if stop is not None:
            def watch() -> None:
                stop.wait()
                engine.stop.set()
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
        started: list[threading.Thread] = []
        try:
            engine.declare()
            for t in threads:
                t.start()
                started.append(t)
            summary = engine.run(resume=self.resume)
        finally:
            for agent in agents:
                agent.stop.set()
            deadline = time.time() + 10
            for t in started:
                t.join(timeout=max(deadline - time.time(), 0.1))
            agg_broker.close()
        summary["uploads_confirmed"] = sum(len(a.uploads) for a in self.agent_logs.values())
        return summary
