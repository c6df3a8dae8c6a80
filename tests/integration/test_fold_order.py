"""A synchronous round of 100 folds its updates in grant order whatever order they arrive in, holds one of
them at a time (the others wait on the spool), and a restart in the middle of it gives the same bits."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
from fold_reference import fedavg, noisy_updates, one_round_job, same_bits
from load_factor import budget

from fedmq.aggregator.engine import Engine
from fedmq.aggregator.runlog import read_rounds
from fedmq.broker.transport import topology
from fedmq.broker.transport.connect import connect
from fedmq.broker.wire import messages
from fedmq.tasks.base import model_state

M = 100
AGENTS = [f"agent-{i}" for i in range(M)]


@pytest.fixture(scope="module")
def task(tiny_lm):
    return tiny_lm(M)


def _start(task, url: str, job: str, run: Path) -> tuple[Engine, threading.Thread]:
    cfg = one_round_job(job, M)
    broker = connect(url, user=topology.AGGREGATOR_USER)
    engine = Engine(broker, task, cfg, run, durable=False, evaluate=False)
    runner = threading.Thread(target=engine.run, daemon=True)
    runner.start()
    return engine, runner


def _wait(what, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + budget(timeout)
    while not what() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert what()


def _publish(pub, job: str, bodies: dict[str, bytes], order: list[str]) -> None:
    for client in order:
        pub.publish(topology.rk_update(job, client), bodies[client])


def _selected(task, url: str, job: str, run: Path) -> tuple[Engine, threading.Thread, object]:
    """An engine whose round 1 has selected all M agents (they said hello) and announced."""
    admin = connect(url)
    admin.declare_job(job, AGENTS)
    engine, runner = _start(task, url, job, run)
    for client in AGENTS:
        env = messages.presence(job, client, "online", -1)
        admin.publish(topology.rk_presence(job, client), messages.encode(env), message_id=env.msg_id)
    _wait(lambda: engine.phase == "training" and engine.round == 1)
    return engine, runner, admin


def _one_round(task, tmp_path: Path, name: str, order_seed: int | None) -> tuple[dict, list[str], int]:
    """Round 1 with the updates published in a shuffled order (``order_seed``; None: the fold order
    reversed, so every update but the last comes ahead of its turn): the model, the round's fold order, and
    the most deliveries the engine held at once."""
    job = f"fold-{name}"
    url = f"memory://{job}"
    engine, runner, admin = _selected(task, url, job, tmp_path / name)
    order = sorted(AGENTS)[::-1]
    if order_seed is not None:
        random.Random(order_seed).shuffle(order)
    _publish(admin, job, noisy_updates(engine.global_state, job, AGENTS), order)
    runner.join(timeout=budget(120))
    assert not runner.is_alive()
    rows = read_rounds(tmp_path / name).records
    return dict(engine.global_state), list(rows[0].received), engine.inbox.held_peak


def test_shuffled_arrivals_give_the_same_bits_holding_one_update_at_a_time(task, tmp_path):
    runs = [_one_round(task, tmp_path, f"r{i}", seed) for i, seed in enumerate((None, 1, 2))]
    for _, received, held_peak in runs:
        assert received == sorted(AGENTS)  # folded in grant order, not in arrival order
        # every delivery was settled before the next was taken: the 99 that came early waited on the spool
        assert held_peak == 1
    assert same_bits(runs[1][0], runs[0][0]) and same_bits(runs[2][0], runs[0][0])
    # the check has teeth: the same updates summed in arrival order would not give these bits
    start = {k: v.detach().clone().float() for k, v in model_state(task.build_model(0)).items()}
    bodies = noisy_updates(start, "fold-order", AGENTS)
    mixed = list(AGENTS)
    random.Random(3).shuffle(mixed)
    assert not same_bits(fedavg(task, start, bodies, mixed), fedavg(task, start, bodies, sorted(AGENTS)))


def test_a_restart_with_updates_waiting_on_the_spool_gives_thesame_bits(task, tmp_path):
    plain, _, _ = _one_round(task, tmp_path, "plain", 5)
    job = "fold-restart"
    url = f"memory://{job}"
    run = tmp_path / "restart"
    engine, runner, admin = _selected(task, url, job, run)
    bodies = noisy_updates(engine.global_state, job, AGENTS)
    order = sorted(AGENTS)
    late, early = order[:10], order[10:]
    random.Random(5).shuffle(early)
    _publish(admin, job, bodies, early)  # all ahead of their turn: spooled, acked, not folded
    spool = run / "spool" / "r000001"
    _wait(lambda: len(list(spool.glob("update-*.msg"))) == len(early))
    assert engine.inbox.held() == 0 and not read_rounds(run).records
    engine.stop.set()
    runner.join(timeout=budget(60))
    assert not runner.is_alive()

    again, runner = _start(task, url, job, run)
    _publish(admin, job, bodies, late[::-1])
    runner.join(timeout=budget(120))
    assert not runner.is_alive()
    assert list(read_rounds(run).records[0].received) == order
    assert same_bits(dict(again.global_state), plain)
