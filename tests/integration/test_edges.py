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
from fedmq.aggregator.runlog import read_rounds
from fedmq.broker.transport import topology
from fedmq.broker.transport.connect import connect
from fedmq.broker.wire import messages
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
