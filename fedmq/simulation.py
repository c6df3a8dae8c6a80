"""`fedmq simulate`: an aggregator and K clients in one process, over the in-process broker or RabbitMQ.

Simulated clients are virtual: one host (client_agent.host.Host, ``agent``: clients agent-0 … agent-(K−1))
serves them all over one broker connection, and a client has a thread only while it takes part in a round. The
models they train on come from one TrainerPool of ``trainers`` models, and what an algorithm keeps per client
between rounds lives on disk under the run folder (client_agent.state.DiskStore). Memory is then O(trainers ×
model + selected clients' encoded updates) plus a few hundred bytes a client, not O(K × model). With
``cohort`` the pool trains a round's selected clients together (a model each, O(selected × model); one batched
run on the device). A cohort's agents report when the last of them has trained, so the round's report deadline
-- set for one client's local training -- is given to each of the m selected clients, as if they trained in
turn (m × report_deadline_s: the cohort's worst case, a CPU or a cohort trained in parts); without faults a
round never waits for a deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from fedmq import defaults
from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.edge import Edge
from fedmq.aggregator.engine import Engine
from fedmq.aggregator.runlog import CONFIG_FILE, holds_run
from fedmq.aggregator.strategies.registry import client_hooks
from fedmq.broker.transport import topology
from fedmq.broker.transport.connect import connect
from fedmq.broker.transport.memory import MemoryBroker
from fedmq.broker.transport.urls import url_user
from fedmq.client_agent.agent import AgentLog
from fedmq.client_agent.availability import Availability, Faults, parse_availability, parse_faults
from fedmq.client_agent.host import ASYNC_AT_ONCE, Host
from fedmq.client_agent.state import DiskStore
from fedmq.client_agent.trainers import CohortPool, TrainerPool
from fedmq.errors import BadParameter, FedmqError
from fedmq.population import check_population
from fedmq.tasks.base import Task

log = structlog.get_logger(__name__)
# The in-process broker moves references, not bytes: chunking a model there (as RabbitMQ's message size limit
# requires) would only copy it twice. Chunking is covered by the contract suite on both backends.
IN_PROCESS_CHUNK_LIMIT = 1 << 31
SIM_HOST = "agent"  # the simulation's one host: its clients are agent-0 … agent-(K-1)
STOP_WAIT_S = 60.0  # how long a run that ends waits for its agents and their local training to stop


class RunFolderInUse(FedmqError):
    """``run_dir`` already holds a run (config.json or metrics.jsonl) and ``resume`` was not asked for, or
    ``resume`` was asked for and there is no run to continue: one run per folder, as `fedmq simulate --out`
    (cli/run_folder.py), so two runs' metrics, checkpoints and TensorBoard steps never mix."""

    exit_code = 2


class SimulationFailed(FedmqError):
    """An agent or the aggregator failed: the run ended at once; the message is the first cause, in one line.
    Exit code 1 (a run that broke), not 2 (a command line that was wrong)."""

    exit_code = 1


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


@dataclass
class Simulation:
    cfg: JobConfig
    task: Task
    broker_url: str = "memory://sim"
    run_dir: Path = Path("runs/sim")
    availability: str = "always"
    faults: str = ""
    device: str = "cpu"
    resume: bool = False  # continue the run in run_dir; without it a run_dir that holds a run is refused
    rejoin_s: float = 1.0
    trainers: int = defaults.TRAINERS  # models that train at once (client_agent.trainers.TrainerPool)
    cohort: bool = False  # train a round's selected clients together (client_agent.trainers.CohortPool)
    keep_queues: bool = False  # over RabbitMQ: leave the job's queues on the broker after the run
    on_round: Callable[[dict], None] | None = None
    on_local_progress: Callable[[str, int, int], None] | None = None
    on_start: Callable[[], None] | None = None  # once the broker answered and the job's queues exist
    agent_logs: dict[str, AgentLog] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    engine: Engine | None = None
    pool: TrainerPool | None = None  # the run's trainers, once it started

    def _url_user(self) -> str | None:
        if self.broker_url.startswith("memory://"):
            return None
        return url_user(self.broker_url) or "guest"

    def _run_config(self, shared_user: str | None) -> JobConfig:
        """The job as this run holds it: checked for the population and ``cohort``, with the broker URL's
        account as every agent's identity, report deadlines stretched for a cohort."""
        cfg = self.cfg
        check_population(cfg.clients, cfg.most_selected() if cfg.mode == "sync" else ASYNC_AT_ONCE)
        if shared_user:  # every agent shares the URL's account: check the user, not per-agent identity
            cfg = replace(cfg, identity=f"shared:{shared_user}")
        if self.cohort and any(hook.changes_training() for hook, _ in client_hooks(cfg)):
            raise BadParameter(
                f"--cohort trains a round's clients as one batched model, which cannot run the client hook "
                f"of strategy {cfg.strategy!r}; run it without --cohort"
            )
        if self.cohort:  # the module docstring says why
            cfg = replace(cfg, report_deadline_s=cfg.report_deadline_s * cfg.most_selected())
        return cfg

    def run(self, stop: threading.Event | None = None) -> dict[str, Any]:
        self._check_run_dir()
        shared_user = self._url_user()
        cfg = self._run_config(shared_user)
        availability = parse_availability(self.availability, cfg.seed)
        faults = parse_faults(self.faults, cfg.seed)
        memory = shared_user is None
        limit = {"chunk_limit": IN_PROCESS_CHUNK_LIMIT} if memory else {}
        agg_broker = connect(self.broker_url, user=topology.AGGREGATOR_USER if memory else None, **limit)
        self.engine = engine = Engine(
            agg_broker,
            self.task,
            cfg,
            self.run_dir,
            durable=shared_user is not None,
            device=self.device,
            on_round=self.on_round,
            # privacy noise (--dp) from the job's seed, so that a simulated run repeats: the summary says so
            noise_seed=cfg.seed,
        )
        # a cohort pool holds a model per agent training at once (built on first borrow: the selected ones)
        self.pool = pool = (
            CohortPool(self.task, max(self.trainers, cfg.clients), cfg.seed)
            if self.cohort
            else TrainerPool(self.task, self.trainers, cfg.seed)
        )
        # two-tier aggregation: the edge aggregators, each with its own connection as the aggregator's user
        edges = [
            Edge(
                connect(self.broker_url, user=topology.AGGREGATOR_USER if memory else None, **limit),
                self.task,
                cfg,
                i,
                self.run_dir,
            )
            for i in range(cfg.edges)
        ]
        host = self._host(cfg, pool, availability, faults, limit if memory else None)
        self.agent_logs = host.logs
        host_thread = threading.Thread(target=self._run_host, args=(host,), name="host", daemon=True)
        watcher = None
        if stop is not None:

            def watch() -> None:
                stop.wait()
                engine.stop.set()

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
        started: list[threading.Thread] = []
        edge_threads = [
            threading.Thread(target=self._run_edge, args=(e,), name=e.name, daemon=True) for e in edges
        ]
        try:
            engine.declare()
            for t in edge_threads:
                t.start()
            if self.on_start:
                self.on_start()
            host_thread.start()
            started.append(host_thread)
            try:
                summary = engine.run(resume=self.resume)
            except (
                Exception
            ) as exc:  # the traceback goes to the run's log; the user gets the cause in one line
                log.error("aggregator failed", exc_info=True, file_only=True)
                self._fail(f"aggregator: {_one_line(exc)}")
        finally:
            host.stop.set()
            for edge in edges:
                edge.stop.set()
            for t in edge_threads:
                if t.ident is not None:
                    t.join(timeout=STOP_WAIT_S)
            for edge in edges:
                edge.broker.close()
            self._wait_for_agents(pool, started)
            queues: list[str] | None = None  # the job's queues on the broker, deleted at the end
            if isinstance(agg_broker, MemoryBroker):  # the in-process hub outlives the run: leave nothing
                queues = agg_broker.purge_job(cfg.job)
            agg_broker.close()
            if not memory and not self.keep_queues:
                queues = self._delete_queues([SIM_HOST], cfg.edges)
        if self.failures:
            raise SimulationFailed(self.failures[0])
        summary["uploads_confirmed"] = sum(len(a.uploads) for a in self.agent_logs.values())
        summary["job"] = cfg.job
        if queues is not None:
            summary["broker_queues"] = len(queues)
            summary["inbox_left"] = 0  # deleted with the job's queues
        return summary

    def _host(
        self,
        cfg: JobConfig,
        pool: TrainerPool,
        availability: Availability,
        faults: Faults,
        limit: dict[str, int] | None,
    ) -> Host:
        """The run's one host, serving every client; each client's kept state is on disk. ``limit``: the
        in-process broker's (its host connects as the job's host user), None over RabbitMQ."""
        host_user = topology.host_user(cfg.job, SIM_HOST) if limit is not None else None
        return Host(
            lambda: connect(self.broker_url, user=host_user, **(limit or {})),
            cfg.job,
            SIM_HOST,
            [(0, cfg.clients)],
            self.task,
            availability=availability,
            faults=faults,
            device=self.device,
            heartbeat_s=cfg.heartbeat_s,
            rejoin_s=self.rejoin_s,
            seed=cfg.seed,
            seeded_noise=True,
            trainers=pool,
            store=DiskStore(self.run_dir / "clients"),
            progress=self.on_local_progress,
            strategy=cfg.strategy,
        )

    @staticmethod
    def _wait_for_agents(pool: TrainerPool, started: list[threading.Thread]) -> None:
        """Nothing may be left inside torch when the run returns: a daemon thread that is makes the process
        abort at exit (TrainerPool.wait_idle). Closing the pool first stops local training at its next step
        and turns away agents still waiting for a model (async agents always have a round going)."""
        pool.close()
        deadline = time.time() + STOP_WAIT_S
        for t in started:
            t.join(timeout=max(deadline - time.time(), 0.1))
        late = [t.name for t in started if t.is_alive()]
        if late or not pool.wait_idle(max(deadline - time.time(), 0.1)):
            log.warning("agents still at work after the run", agents=late, seconds=STOP_WAIT_S)

    def _check_run_dir(self) -> None:
        """One run per folder: a folder that holds a run is continued only with ``resume=True``."""
        run_dir = Path(self.run_dir)
        if run_dir.exists() and not run_dir.is_dir():
            raise RunFolderInUse(f"run_dir {run_dir} is a file; give a folder for the run")
        held = holds_run(run_dir)
        if self.resume and CONFIG_FILE not in held:
            raise RunFolderInUse(f"resume=True needs a run to continue; {run_dir} has no {CONFIG_FILE}")
        if held and not self.resume:
            raise RunFolderInUse(
                f"run_dir {run_dir} already holds a run ({held[0]}); pass resume=True to continue it, "
                "or choose another run_dir"
            )

    def status(self) -> dict[str, Any]:
        """The aggregator's live status (`simulate --metrics-port`); "starting" until its engine exists."""
        return self.engine.status() if self.engine is not None else {"phase": "starting"}

    def _run_host(self, host: Host) -> None:
        """Host.run, but a failure ends the whole simulation at once (the first cause is what the user
        sees, with the client it came from)."""
        try:
            host.run()
        except Exception as exc:
            client = host.failed_client or host.host
            if host.stop.is_set() and host.failure is None:  # the run is over: not a failure
                log.debug("host stopped with the run", reason=_one_line(exc))
                return
            log.error("agent failed", client=client, exc_info=True, file_only=True)
            self._fail(f"agent {client}: {_one_line(exc)}")

    def _run_edge(self, edge: Edge) -> None:
        """Edge.run; a failure ends the whole simulation, as an agent's does."""
        try:
            edge.run()
        except Exception as exc:
            log.error("edge aggregator failed", edge=edge.name, exc_info=True, file_only=True)
            self._fail(f"edge {edge.name}: {_one_line(exc)}")

    def _fail(self, cause: str) -> None:
        self.failures.append(cause)
        if self.engine is not None:
            self.engine.stop.set()

    def _delete_queues(self, agents: list[str], edges: int = 0) -> list[str] | None:
        """A simulation's job exists only for the run: leave nothing on the broker (unless keep_queues).
        The names deleted; None when it could not."""
        from fedmq.broker.transport.provision import purge

        try:
            deleted = purge(self.broker_url, self.cfg.job, agents, edges)
            log.info("deleted the job's queues", job=self.cfg.job, queues=len(deleted))
            return deleted
        except FedmqError as exc:
            log.warning("could not delete the job's queues", job=self.cfg.job, error=str(exc))
            return None
