"""A host: one agent process serving many clients of a job over one broker connection.

A population is then N processes × M clients, not one process (two queues, threads, a connection) per
client. The host owns two queues on the broker, named for the host as a one-client agent's are for its
client; the aggregator sends a round's announcement and grant once per host (listing the selected and
granted clients), and the host's presence -- one beat per heartbeat for all its clients, with its roster as
ranges of client numbers -- keeps them all online. Clients are named ``<host>-<n>`` (n: the client's number
in the population, its data partition) and speak through the host's broker user: identity is per host.

A client costs nothing until it is selected: no thread, no object but what the job's algorithm keeps for it
(the state store, on disk in a simulation). A selected client runs the one-client agent's round
(client_agent.agent.Agent._on_announce) in a thread of its own, over the host's connection; the thread
ends with the round (in an asynchronous job under secure aggregation, a round that has checked in to a
secure buffer is parked: it waits for its cohort while the client trains from the next version, as in the
clear). A client that goes offline in its availability model, or is cut by a fault,
is down for ``rejoin_s`` (the one-client agent's rejoin delay), saying so when it leaves gracefully; an
announcement that selects it while down waits for its return, as it would in its own announcement queue.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import structlog

from fedmq import defaults
from fedmq.broker.transport import topology
from fedmq.broker.transport.base import Broker, Delivery
from fedmq.broker.transport.errors import BrokerError
from fedmq.broker.wire import messages
from fedmq.broker.wire.envelope import Envelope, Kind
from fedmq.client_agent.agent import Agent, AgentArgs, AgentLog, ClientHookError, Offline
from fedmq.client_agent.joining import ROUND_STEPS, decode_event, join, leave, publish_presence
from fedmq.client_agent.relay import Events, Relay
from fedmq.client_agent.state import MemoryStore
from fedmq.client_agent.trainers import TrainerPool
from fedmq.errors import CodecError
from fedmq.tasks.base import Task

log = structlog.get_logger(__name__)

Ranges = Sequence[tuple[int, int]]
ASYNC_AT_ONCE = 64  # asynchronous rounds: a host's clients training at once (the others take turns)
PARKED_AT_ONCE = 64  # secure buffers: a host's rounds parked at once, each holding its client's change
NEVER = messages.NO_VERSION - 1  # "trained from" a client that has not trained


class Host:
    """Serves the clients numbered in ``clients`` ([start, stop) ranges) of ``job``; see the module docstring.
    Keyword arguments are the one-client Agent's, given to every client's round."""

    agent_class: type[Agent] = Agent  # what runs a client's round (a subclass: the hostile tests)

    def __init__(
        self,
        connect: Callable[[], Broker],
        job: str,
        host: str,
        clients: Ranges,
        task: Task,
        *,
        heartbeat_s: float = defaults.HEARTBEAT_S,
        rejoin_s: float = defaults.REJOIN_S,
        seed: int = 0,
        trainers: TrainerPool | None = None,
        store: Any = None,
        **agent_args: Unpack[AgentArgs],
    ) -> None:
        self.connect, self.job, self.host = connect, job, topology.check_host(host)
        self.ranges = [(int(lo), int(hi)) for lo, hi in clients]
        self.heartbeat_s, self.rejoin_s = heartbeat_s, rejoin_s
        self.trainers = trainers or TrainerPool(task, defaults.TRAINERS, seed)
        self._agent_args: dict[str, Any] = dict(
            agent_args,
            heartbeat_s=heartbeat_s,
            rejoin_s=rejoin_s,
            seed=seed,
            trainers=self.trainers,
            store=store if store is not None else MemoryStore(),  # one for all: rounds come and go
        )
        self.task = task
        self.stop = threading.Event()
        self.finished = False
        # a running client's error that ends the host (run() raises it), and the client it came from
        self.failure: BaseException | None = None
        self.failed_client = ""
        self.logs: dict[str, AgentLog] = {}  # per client that took part in a round
        self._holds: dict[str, int] = {}  # the version each client keeps (only those that keep one)
        self._last_round: dict[str, int] = {}
        self._down: dict[str, float] = {}  # client -> when it comes back
        self._waiting: dict[str, Envelope] = {}  # the newest announce that selected a client while down
        self._running: dict[str, tuple[Agent, Events, threading.Thread]] = {}
        # rounds that checked in to a secure buffer and wait for its cohort, their places given up (_park)
        # (the version each counts as trained from, which _trained names unless the client trained since)
        self._parked: dict[threading.Thread, tuple[Agent, Events, int]] = {}
        self._again: set[threading.Thread] = set()  # parked rounds whose version was announced again
        self._async_newest: Envelope | None = None
        # asynchronous rounds: the version each client last trained from, where the round robin of free
        # places looks next, and the version for which it found nobody left to train
        self._trained: dict[str, int] = {}
        self._turn = 0
        self._exhausted = NEVER
        self._lock = threading.Lock()
        self._broker: Broker | None = None

    # ------------------------------------------------------------------ clients
    def number(self, client: str) -> int | None:
        """The number of ``client`` if this host serves it, else None."""
        host, _, n = client.partition("-")
        if host != self.host or not n.isdigit():
            return None
        k = int(n)
        return k if any(lo <= k < hi for lo, hi in self.ranges) else None

    def count(self) -> int:
        return sum(hi - lo for lo, hi in self.ranges)

    # ------------------------------------------------------------------ connection
    def run(self) -> None:
        """Serve until the job ends or ``stop`` is set; raises what ended it for good (as Agent.run)."""
        while not self.stop.is_set():
            try:
                self._join()
                self._serve()
            except BrokerError as exc:
                self._leave(False)
                if exc.permanent:
                    raise
                log.warning("broker connection lost", host=self.host, error=str(exc))
                self.stop.wait(self.rejoin_s)
        ended = self._end_rounds()
        # an offline beat must not overtake a client's upload still under way (presence has its own lane)
        self._leave(not self.finished and ended)
        if self.failure is not None:
            raise self.failure

    def _join(self) -> None:
        joined = join(self.connect, self.job, self.host, self.stop, lambda b: self._beat(broker=b))
        if joined is not None:
            self._broker, self._events = joined
            log.info("host joined", host=self.host, clients=self.count())
            with self._lock:  # rounds lost with the connection: their clients have not trained from the
                self._exhausted = NEVER  # newest version, and nothing will announce it again
                self._async_fill()

    @property
    def connected(self) -> bool:
        """Joined the job (for /readyz): False while offline, reconnecting or stopped."""
        return self._broker is not None

    def _beat(self, state: str = "online", broker: Broker | None = None) -> None:
        broker = broker or self._broker
        if broker is None:
            return
        env = messages.host_presence(self.job, self.host, state, self.ranges)
        publish_presence(broker, self.job, self.host, env, 3 * self.heartbeat_s)

    def _leave(self, graceful: bool) -> None:
        broker, self._broker = self._broker, None
        leave(broker, (lambda b: self._beat("offline", b)) if graceful else None)

    # ------------------------------------------------------------------ serving
    def _serve(self) -> None:
        next_beat = time.monotonic() + self.heartbeat_s
        while not self.stop.is_set():
            if self.failure is not None:
                self.stop.set()
                return
            delivery = self._events.next(min(0.2, self.heartbeat_s))
            if delivery is not None:
                self._route(delivery)
            self._rejoin_due()
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.heartbeat_s
                self._beat()

    def _route(self, delivery: Delivery) -> None:
        broker = self._broker
        assert broker is not None
        try:
            env = decode_event(delivery.body, self.job)
        except CodecError as exc:
            log.warning("message rejected", host=self.host, reason=exc.reason)
            broker.reject(delivery, requeue=False)
            return
        broker.ack(delivery)
        if env.kind is Kind.END:
            log.info("job finished: leaving", host=self.host, rounds=env.payload["rounds"])
            self.finished = True
            self.stop.set()
        elif env.kind in ROUND_STEPS:  # each running client reads what concerns it
            with self._lock:
                for _, events, _ in [*self._running.values(), *self._parked.values()]:
                    events.put(delivery)
        elif env.payload["mode"] == "sync":
            for client in env.payload["selected"]:
                if self.number(client) is not None:
                    self._offer(client, env, delivery)
        else:  # asynchronous: every client of ours that is up trains on the newest version, in turns
            with self._lock:
                last = self._async_newest
                again = (
                    last is not None and env.model_version == last.model_version and env.round > last.round
                )
                if again and "secagg_clip" in env.payload["config"]:
                    # a secure buffer's version again: its buffer was skipped, and the masked inputs sent to
                    # it were not kept: the clients that trained from it train from it again, but for those
                    # whose check-in from it still waits (a member's parked round, released, ends: _round_
                    # ended); in the clear an update that comes after the skip is folded in the next round
                    skipped = env.model_version
                    parked = [(t, a.client) for t, (a, _, v) in self._parked.items() if v == skipped]
                    self._again.update(t for t, _ in parked)
                    keep = {c for _, c in parked}
                    self._trained = {c: v for c, v in self._trained.items() if v != skipped or c in keep}
                self._async_newest = env
                self._exhausted = NEVER  # a new announce (a skipped round re-announces its version)
                self._async_fill()

    def _async_fill(self) -> None:
        """Give free places (ASYNC_AT_ONCE in all) to clients that have not trained from the newest
        version, round robin over the host's clients (the caller holds the lock). A client whose turn comes
        after a newer version is announced trains from that one."""
        newest = self._async_newest
        if newest is None or self.stop.is_set() or self._exhausted >= newest.model_version:
            return
        total = self.count()
        for _ in range(total):
            if len(self._running) >= ASYNC_AT_ONCE:
                return
            client = self._nth(self._turn)
            self._turn = (self._turn + 1) % total
            due = client not in self._running and client not in self._down
            if due and self._trained.get(client, NEVER) < newest.model_version:
                if not self._start(client, newest):
                    return  # between connections: the next fill looks again
        self._exhausted = newest.model_version  # a whole turn found nobody left: wait for a new announce

    def _nth(self, i: int) -> str:
        """The i-th of the host's clients, in the order of its ranges."""
        for lo, hi in self.ranges:
            if i < hi - lo:
                return topology.host_client(self.host, lo + i)
            i -= hi - lo
        raise IndexError(i)

    def _offer(self, client: str, env: Envelope, delivery: Delivery) -> None:
        """Hand an announcement to ``client``: its running round if it has one, else a new one (or, while it
        is down, keep it for its return)."""
        with self._lock:
            if client in self._running:
                self._running[client][1].put(delivery)
            elif client in self._down:
                self._waiting[client] = env
            else:
                self._start(client, env)

    def _start(self, client: str, env: Envelope) -> bool:
        """A thread for ``client``'s round (the caller holds the lock); False when none could start."""
        number = self.number(client)
        if number is None or self._broker is None:  # not ours, or the host is between connections
            return False
        agent = self.agent_class(self.connect, self.job, client, number, self.task, **self._agent_args)
        agent.log = self.logs.setdefault(client, AgentLog())
        agent.version = self._holds.get(client, messages.NO_VERSION)
        agent.last_round = self._last_round.get(client, 0)
        agent._broker = Relay(self)
        events = Events()
        agent._events = events  # type: ignore[assignment]
        agent.on_check_in = self._park
        thread = threading.Thread(target=self._run_round, args=(agent, events, env), name=client, daemon=True)
        self._running[client] = (agent, events, thread)
        thread.start()
        return True

    def _park(self, agent: Agent, version: int) -> None:
        """``agent``'s round checked in to a secure buffer with its change from ``version``: it waits for the
        cohort parked, its place free for the next round, this client's own included once a newer version is
        announced (as in the clear, where a client trains again as soon as it uploads; its newer check-in
        replaces this one unless a cohort took this one first). The parked round keeps the version the
        client now counts as trained from (_trained)."""
        with self._lock:
            entry = self._running.get(agent.client)
            if entry is None or entry[0] is not agent or len(self._parked) >= PARKED_AT_ONCE:
                return  # (too many parked: this round waits for its cohort in its place)
            # it trains next from a version announced after it checked in: the one out now takes the check-ins
            # waiting first, so a change from it would reach a buffer no fresher than one from the next, and
            # on a host whose clients share trainers it would queue behind theirs (two versions stale)
            newest = self._async_newest
            trained = max(version, newest.model_version if newest else version)
            del self._running[agent.client]
            self._parked[entry[2]] = (agent, entry[1], trained)
            self._round_over(agent)
            self._trained[agent.client] = trained
            self._async_fill()

    def _round_over(self, agent: Agent) -> None:
        """What the host keeps of a client's round once it is over or parked (the caller holds the lock)."""
        self._last_round[agent.client] = agent.last_round
        if agent.version == messages.NO_VERSION:
            self._holds.pop(agent.client, None)
        else:
            self._holds[agent.client] = agent.version

    def _run_round(self, agent: Agent, events: Events, env: Envelope) -> None:
        client, down = agent.client, False
        try:
            agent._on_announce(env)
        except Offline as off:
            down = True
            if off.graceful:
                try:
                    agent._presence("offline")
                except BrokerError as exc:
                    log.warning("could not say a client left", client=client, error=str(exc))
            log.info("client offline", client=client, why=str(off))
        except BrokerError as exc:  # the host's connection went: the round is lost for this client
            if exc.permanent:
                self._fail(client, exc)
            log.warning("client's round lost with the connection", client=client, error=str(exc))
        except (ClientHookError, Exception) as exc:  # as a one-client agent's: it ends the host
            if not self.stop.is_set():
                log.error("client failed", client=client, exc_info=True, file_only=True)
                self._fail(client, exc)
        finally:
            with self._lock:
                self._round_ended(agent, events, env, down)

    def _round_ended(self, agent: Agent, events: Events, env: Envelope, down: bool) -> None:
        """What follows a client's round (the caller holds the lock): its next round, or its time down."""
        client = agent.client
        thread = threading.current_thread()
        parked = self._parked.pop(thread, None)
        if parked is not None:
            # its check-in was refused, its buffer ended before it answered the unmasking, or its version was
            # announced again (a skipped buffer's, which may have been its own): it trains from the newest
            # version again, unless it did meanwhile
            again = thread in self._again
            self._again.discard(thread)
            if (again or not agent.answered) and self._trained.get(client) == parked[2]:
                del self._trained[client]
                self._exhausted = NEVER
            if down:
                self._down[client] = time.monotonic() + self.rejoin_s
            self._async_fill()
            return
        del self._running[client]
        # an announce routed here as the round ended (it selects the client again): not lost
        newer = [
            e
            for d in events.drain()
            if (e := messages.decode(d.body)).kind is Kind.ANNOUNCE and e.round > agent.last_round
        ]
        self._round_over(agent)
        # done with this version: uploaded, or offline for it (availability is per version)
        done = down or agent.uploaded > 0
        if env.payload["mode"] == "async" and done:
            self._trained[client] = env.model_version
        if down:
            self._down[client] = time.monotonic() + self.rejoin_s
            if newer:
                self._waiting[client] = newer[-1]
        elif newer and not self.stop.is_set():
            self._start(client, newer[-1])
        elif env.payload["mode"] == "async":
            newest = self._async_newest
            if newest is not None and self._trained.get(client, NEVER) < newest.model_version:
                self._exhausted = NEVER  # it is free and has not trained from the newest
        self._async_fill()  # a place is free: asynchronous rounds give the next client its turn

    def _fail(self, client: str, exc: BaseException) -> None:
        if self.failure is None:
            self.failure, self.failed_client = exc, client

    def _rejoin_due(self) -> None:
        if not self._down:
            return
        now = time.monotonic()
        with self._lock:
            due = [c for c, at in self._down.items() if at <= now]
            if due:
                self._exhausted = NEVER  # clients back: the next turn looks at them too
            for client in due:
                version = self._holds.get(client, messages.NO_VERSION)
                env = messages.presence(self.job, client, "online", version)
                assert self._broker is not None
                # a BrokerError leaves it down: it says so again after the reconnect
                publish_presence(self._broker, self.job, client, env)
                del self._down[client]
                waiting = self._waiting.pop(client, None)
                if waiting is not None:
                    self._start(client, waiting)
            self._async_fill()

    def _end_rounds(self, wait_s: float = 5.0) -> bool:
        """Stop every running client (the job ended, or the host is stopping) and wait at most ``wait_s`` in
        all; True when none is left."""
        with self._lock:
            running = [(a, t) for a, _, t in self._running.values()]
            running += [(a, t) for t, (a, _, _) in self._parked.items()]
        for agent, _ in running:
            agent.finished = self.finished
            agent.stop.set()
        deadline = time.monotonic() + wait_s
        for _, thread in running:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        return not any(thread.is_alive() for _, thread in running)
