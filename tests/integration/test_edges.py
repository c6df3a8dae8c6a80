"""Two-tier aggregation in one process: a root engine and four edge aggregators over the in-process broker. A
round of 100 updates published in shuffled orders gives the same bits every time, equal to one aggregator's
FedAvg within float32 summation error; the edges hold one delivery at a time; a strategy that needs each
client's update is refused in one line."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch
from fold_reference import fedavg, noisy_updates, one_round_job, same_bits
from load_factor import budget

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.edge import Edge
from fedmq.aggregator.engine import Engine
from fedmq.aggregator.inbox import Inbox
from fedmq.aggregator.runlog import read_rounds
from fedmq.broker.transport import topology
from fedmq.broker.transport.connect import connect
from fedmq.broker.wire import messages
from fedmq.broker.wire.encodings import EncodingSpec, encode_state
from fedmq.errors import FedmqError
from fedmq.tasks.base import model_state

M = 100
EDGES = 4
AGENTS = [f"agent-{i}" for i in range(M)]


@pytest.fixture(scope="module")
def task(tiny_lm):
    return tiny_lm(M)


def _cfg(job: str, **extra) -> JobConfig:
    return one_round_job(job, M, **{"edges": EDGES, **extra})


def _wait(what, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + budget(timeout)
    while not what() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert what()


def _one_round(task, tmp_path: Path, name: str, order_seed: int) -> tuple[dict, list[str], list[Edge]]:
    """Round 1 over four edges, the updates published in a shuffled order: the model, the round's
    received clients in fold order, and the edges."""
    job = f"edges-{name}"
    url = f"memory://{job}"
    run = tmp_path / name
    cfg = _cfg(job)
    admin = connect(url)
    admin.declare_job(job, AGENTS)
    engine = Engine(
        connect(url, user=topology.AGGREGATOR_USER), task, cfg, run, durable=False, evaluate=False
    )
    edges = [Edge(connect(url, user=topology.AGGREGATOR_USER), task, cfg, e, run) for e in range(EDGES)]
    threads = [threading.Thread(target=x.run, daemon=True) for x in (engine, *edges)]
    for t in threads:
        t.start()
    for client in AGENTS:
        env = messages.presence(job, client, "online", -1)
        admin.publish(topology.rk_presence(job, client), messages.encode(env), message_id=env.msg_id)
    _wait(lambda: engine.phase == "training" and all(e.open is not None for e in edges))
    bodies = noisy_updates(engine.global_state, job, AGENTS)
    order = list(AGENTS)
    random.Random(order_seed).shuffle(order)
    for client in order:
        edge = topology.edge_of(client, EDGES)
        admin.publish(topology.rk_edge_update(job, client, edge), bodies[client])
    threads[0].join(timeout=budget(120))
    assert not threads[0].is_alive()
    for t in threads[1:]:  # the job's end tells the edges to leave
        t.join(timeout=budget(30))
        assert not t.is_alive()
    rows = read_rounds(run).records
    return dict(engine.global_state), list(rows[0].received), edges


def test_edges_give_the_same_bits_in_any_arrival_order_and_one_aggregators_fedavg(task, tmp_path):
    runs = [_one_round(task, tmp_path, f"r{i}", seed) for i, seed in enumerate((1, 2))]
    for _, received, edges in runs:
        assert received == sorted(AGENTS)  # every update folded, none lost
        assert sum(e.partials for e in edges) == EDGES and all(e.ended for e in edges)
        assert all(e.inbox.held_peak == 1 for e in edges)  # each update spooled and acked before the next
    assert same_bits(runs[0][0], runs[1][0])
    start = {k: v.detach().clone().float() for k, v in model_state(task.build_model(0)).items()}
    one = fedavg(task, start, noisy_updates(start, "edges-one", AGENTS), sorted(AGENTS))
    assert not same_bits(runs[0][0], one)  # the sums associate differently: float32 rounding, no more
    for name, tensor in one.items():
        torch.testing.assert_close(runs[0][0][name], tensor, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("extra", "word"),
    [({"strategy": "fedatt"}, "fedatt"), ({"robust": "median"}, "median"), ({"strategy": "async"}, "async")],
)
def test_a_strategy_that_needs_each_update_is_refused_with_edges_in_one_line(extra, word):
    with pytest.raises(FedmqError) as err:
        _cfg("edges-refused", **extra)
    assert "edges" in str(err.value) and word in str(err.value) and "\n" not in str(err.value)


class _Root:
    """The root's side of one edge, played by the test: the exact model in the stream, edge-rounds, and the
    partial sums the edge sends (read from the inbox)."""

    def __init__(self, task, tmp_path: Path, job: str, clients: int) -> None:
        self.url, self.job = f"memory://{job}", job
        self.cfg = one_round_job(job, clients, edges=1)
        self.me = connect(self.url, user=topology.AGGREGATOR_USER)
        self.me.declare_job(job, [], model_bytes=1 << 20, edges=(0,))
        self.state = {k: v.detach().clone().float() for k, v in model_state(task.build_model(0)).items()}
        model = messages.model(job, 0, encode_state(self.state, EncodingSpec.parse("raw")))
        body = messages.encode(model)
        self.me.publish(topology.rk_model(job), body, message_id=model.msg_id)
        self.entry = messages.model_entry(model, time.time() - 1, len(body))
        self.inbox = Inbox(self.me, job, "shared:guest")
        self.inbox.subscribe(topology.q_inbox(job))
        self.edge = Edge(connect(self.url, user=topology.AGGREGATOR_USER), task, self.cfg, 0, tmp_path)
        self.agent = connect(self.url)  # every client: identity shared:guest
        self.bodies = noisy_updates(self.state, job, AGENTS)
        self.thread = threading.Thread(target=self.edge.run, daemon=True)

    def tell(self, rnd: int, clients: list[str]) -> None:
        env = messages.edge_round(self.job, rnd, 0, clients, 600.0, "fedavg", self.entry)
        self.me.publish(topology.rk_edge(self.job, 0), messages.encode(env), message_id=env.msg_id)

    def upload(self, client: str, rnd: int = 1) -> None:
        body = self.bodies[client]
        if rnd != 1:  # the same update, claimed for another round
            env = messages.decode(body)
            body = messages.encode(messages.update(self.job, rnd, client, 0, 1.0, 1, env.payload["tensors"]))
        self.agent.publish(topology.rk_edge_update(self.job, client, 0), body)

    def partial(self) -> messages.Envelope:
        got = self.inbox.next(budget(30))
        assert got is not None and got.env.kind is messages.Kind.PARTIAL
        return got.env

    def close(self) -> None:
        self.edge.stop.set()
        self.thread.join(timeout=budget(30))


def test_an_update_taken_before_its_client_went_offline_is_still_folded(task, tmp_path):
    root = _Root(task, tmp_path, "edge-gone", M)
    root.tell(1, ["agent-1", "agent-2"])
    root.thread.start()
    try:
        root.upload("agent-1")
        _wait(lambda: root.edge.open is not None and "agent-1" in root.edge.open.done)
        root.tell(1, [])  # both went offline; agent-1's update was taken already
        env = root.partial()
        assert set(env.payload["clients"]) == {"agent-1"} and env.payload["failed"] == {}
    finally:
        root.close()


def test_updates_far_ahead_of_the_round_are_dropped_and_an_early_one_for_the_next_round_is_kept(
    task, tmp_path
):
    root = _Root(task, tmp_path, "edge-early", M)
    root.upload("agent-9", 1000)  # the edge's first delivery: it becomes active
    root.thread.start()
    try:
        for rnd in range(1001, 1020):
            root.upload("agent-9", rnd)
        root.upload("agent-3")  # round 1's, before round 1's edge-round: kept
        _wait(lambda: root.edge.inbox.dropped["future-round"] == 20 and 1 in root.edge.early)
        root.tell(1, ["agent-3"])
        env = root.partial()
        assert set(env.payload["clients"]) == {"agent-3"}
        assert root.edge.early == {}  # nothing of round 1000 and later is held
    finally:
        root.close()
