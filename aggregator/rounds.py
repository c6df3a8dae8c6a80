"""What the round runners (aggregator.sync_round, aggregator.async_rounds) share with the engine that drives
them: the record of one round (:class:`RoundStats`) and what a runner may use of the engine
(:class:`RoundContext`, which aggregator.engine.Engine implements). The runners hold a round's logic; the
engine holds the job's lifecycle and state (presence, the global model and its versions, checkpoints,
the run log)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from fedmq.aggregator import secret_pool
from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.guards import RoundGuard, Verdict
from fedmq.aggregator.inbox import Inbox, Received
from fedmq.aggregator.mediator import Mediator
from fedmq.aggregator.spool import RoundSpool
from fedmq.aggregator.strategies.base import ClientUpdate, State, Strategy
from fedmq.broker.transport.base import Broker
from fedmq.broker.wire.envelope import Envelope


@dataclass
class RoundStats:
    """What one round did, for its row in the run log."""

    round: int
    strategy: str = ""
    online: list[str] = field(default_factory=list)
    selected: list[str] = field(default_factory=list)
    reported: dict[str, float] = field(default_factory=dict)  # client -> loss
    granted: list[str] = field(default_factory=list)
    received: list[str] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)  # granted clients whose update was rejected
    # selected clients left out because the broker could not deliver to them (queue deleted): client -> why
    unreachable: dict[str, str] = field(default_factory=dict)
    update_ids: dict[str, str] = field(default_factory=dict)  # client -> msg id of the update folded
    # asynchronous: client -> the newest version its updates folded into this round trained from (the engine
    # keeps it once the round is published: Engine.folded_from)
    trained_from: dict[str, int] = field(default_factory=dict)
    # two-tier aggregation: what the edges' guards decided of their clients (the root's own verdict is empty)
    edge_verdict: Verdict = field(default_factory=Verdict)
    bytes_up: int = 0
    bytes_down: int = 0
    bytes_up_raw: int = 0
    bytes_down_raw: int = 0
    started: float = field(default_factory=time.time)
    cpu_started: float = field(default_factory=secret_pool.cpu_time)

    def dropped(self) -> list[str]:
        """The clients that did not deliver what the round expected of them (its row's ``dropped``): selected
        ones with neither a report nor an update, and granted ones with no update. A client that reported and
        was not granted an upload (FedMed's top-K) was not expected to upload, so it is not one."""
        got = set(self.received)
        return sorted((set(self.selected) - set(self.reported) - got) | (set(self.granted) - got))


@dataclass(frozen=True)
class Arrival:
    """An update to fold (RoundContext.fold): its envelope, decoded already (the inbox's, or the spool's), its
    size on the wire, the model it trained from, its staleness (asynchronous mode), and its delivery when
    live (rejected if the update is bad; None: read from the spool). ``parked``: it came in this run and was
    spooled and acked ahead of its turn (aggregator.sync_round), so a rejection is counted, not settled."""

    env: Envelope
    size: int
    base: State
    staleness: int = 0
    received: Received | None = None
    parked: bool = False


class RoundContext(Protocol):
    """The engine as a round runner sees it."""

    cfg: JobConfig
    broker: Broker
    inbox: Inbox
    spool: RoundSpool
    mediator: Mediator
    guard: RoundGuard
    stop: threading.Event
    round: int  # the open round (sync) or the next version's round number (async)
    version: int  # the global model's version
    global_state: State
    phase: str
    hosted: dict[str, str]  # client -> the host serving it (aggregator.presence.Presence)
    folded_from: dict[str, int]  # client -> newest version a folded update of it trained from (async)
    buffer_size: int  # async: K, fold every K arrivals (the strategy's; aggregator.async_rounds.async_window)
    max_staleness: int  # async: the oldest version an update may train from, this many back
    noise_seed: int | None  # DP: the job's seed where noise and sampling are seeded (simulate), else None

    def online(self) -> list[str]: ...

    def within_budget(self) -> bool: ...  # one more release keeps ε within the job's target (DP)

    def wait_for_agents(
        self, needed: int, timeout: float, handle: Callable[[Received], None] | None = None
    ) -> None: ...

    def note_presence(self, msg: Received) -> list[str]: ...

    def announce(self, stats: RoundStats) -> None: ...

    def recipients(self, clients: list[str]) -> dict[str, list[str]]: ...

    def leave_out(self, stats: RoundStats, client: str, why: str) -> None: ...

    def took_update(self) -> None: ...  # an update folded or parked (now and then the heap is trimmed)

    def begin_strategy(self, stats: RoundStats, choice: str, **extra: object) -> Strategy: ...

    def fold(
        self, stats: RoundStats, strategy: Strategy, arrival: Arrival, *, screen: bool = False
    ) -> ClientUpdate | None: ...

    def decode_update(
        self, env: Envelope, base: State, staleness: int = 0, n_samples: int | None = None
    ) -> ClientUpdate: ...

    def fold_partial(
        self, stats: RoundStats, strategy: Strategy, arrival: Arrival, routed: set[str]
    ) -> bool: ...

    def tell_edge(
        self, stats: RoundStats, edge: int, clients: list[str], deadline_s: float, first: bool = True
    ) -> None: ...

    def note_trained_from(self, client: str, version: int) -> None: ...

    def close_round(
        self, stats: RoundStats, strategy: Strategy | None, skipped: str | None = None
    ) -> None: ...

    def folded_ids(self) -> set[str]: ...
