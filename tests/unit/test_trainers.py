"""TrainerPool: each trainer's work runs on one thread of its own (CUDA keeps handles per thread)."""

from __future__ import annotations

import threading
import time

import pytest

from fedmq.client_agent.trainers import PoolClosed, TrainerPool, _TurnGate
from fedmq.tasks.base import TrainConfig
from fedmq.tasks.registry import make_task


@pytest.fixture(scope="module")
def pool():
    return TrainerPool(make_task("lm", data="builtin", model="gru-tiny", clients=2, seed=0), size=2, seed=0)


def test_work_runs_on_the_trainers_own_thread(pool):
    callers = [threading.Thread(target=lambda: None) for _ in range(3)]
    seen: list[str] = []
    with pool.borrow() as model:

        def record() -> None:
            seen.append(pool.run(model, lambda: threading.current_thread().name))

        for t in callers:
            t.run = record  # three different agent threads, one model
            t.start()
            t.join()
        assert pool.run(model, lambda a, b=0: a + b, 2, b=3) == 5
    assert len(seen) == 3 and len(set(seen)) == 1
    assert seen[0].startswith("trainer-") and seen[0] != threading.current_thread().name


def test_the_works_exception_reaches_the_caller(pool):
    with pool.borrow() as model:
        with pytest.raises(ValueError, match="bad shard"):
            pool.run(model, lambda: (_ for _ in ()).throw(ValueError("bad shard")))
        assert pool.run(model, lambda: "still serving") == "still serving"


def test_close_lets_go_of_the_models():
    pool = TrainerPool(make_task("lm", data="builtin", model="gru-tiny", clients=2, seed=0), size=1, seed=0)
    with pool.borrow() as model:
        assert pool.run(model, lambda: "trained") == "trained"
    assert not pool._free.empty()
    pool.close()
    assert pool._free.empty()


def test_a_model_given_back_after_close_is_let_go():
    pool = TrainerPool(make_task("lm", data="builtin", model="gru-tiny", clients=2, seed=0), size=1, seed=0)
    with pool.borrow():
        pool.close()  # the run ends while an agent still holds its model
    assert pool._free.empty()


def test_close_stops_training_at_its_next_step_and_turns_away_waiting_borrowers():
    """A run that ends must leave no thread inside torch (a daemon thread still there at exit aborts the
    process): close stops the training under way, refuses a borrower still waiting, and wait_idle says when
    the trainer threads are idle."""
    pool = TrainerPool(make_task("lm", data="builtin", model="gru-tiny", clients=2, seed=0), size=1, seed=0)
    training, outcome = threading.Event(), {}

    def agent() -> None:
        with pool.borrow() as model:
            try:
                pool.train(model, 0, TrainConfig(epochs=100), lambda done, total: training.set())
            except PoolClosed as exc:
                outcome["trainer"] = exc

    def waiting() -> None:
        try:
            with pool.borrow():
                outcome["waiter"] = "borrowed after close"
        except PoolClosed as exc:
            outcome["waiter"] = exc

    threads = [threading.Thread(target=agent), threading.Thread(target=waiting)]
    threads[0].start()
    assert training.wait(30)
    threads[1].start()
    time.sleep(0.1)
    assert not pool.wait_idle(0.01)  # training under way
    pool.close()
    for t in threads:
        t.join(10)
    assert isinstance(outcome["trainer"], PoolClosed) and isinstance(outcome["waiter"], PoolClosed)
    assert pool.wait_idle(10)
    with pytest.raises(PoolClosed, match="closed"):
        pool.run(pool.task.build_model(0), lambda: "work after the run")


def test_agents_of_a_process_share_one_decode_of_a_model_message(pool):
    calls: list[str] = []

    def decode(name: str) -> dict[str, str]:
        calls.append(name)
        time.sleep(0.05)  # the other threads arrive while the first decodes
        return {"model": name}

    got: list[dict[str, str]] = []
    threads = [
        threading.Thread(target=lambda: got.append(pool.shared_decode(("m1", ("w",)), lambda: decode("m1"))))
        for _ in range(4)
    ]
    with pool.ahead():  # an agent between its fetch and the end of its training
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert calls == ["m1"] and len(got) == 4 and all(g is got[0] for g in got)
        # other messages (the forms of a new version) or other tensors read from one: decoded again; the
        # newest three are kept, so the oldest, m1, is decoded again when asked for
        assert pool.shared_decode(("m2", ("w",)), lambda: decode("m2")) == {"model": "m2"}
        assert pool.shared_decode(("m2", ("w", "extra")), lambda: decode("m2+")) == {"model": "m2+"}
        assert pool.shared_decode(("m3", ("w",)), lambda: decode("m3")) == {"model": "m3"}
        assert pool.shared_decode(("m2", ("w",)), lambda: decode("m2 again")) == {"model": "m2"}
        assert pool.shared_decode(("m1", ("w",)), lambda: decode("m1 again")) == {"model": "m1 again"}
        assert calls == ["m1", "m2", "m2+", "m3", "m1 again"]
    # the last agent left: the process keeps no decoded model between rounds
    assert pool.shared_decode(("m3", ("w",)), lambda: decode("m3 again")) == {"model": "m3 again"}


def test_a_failed_decode_is_not_shared(pool):
    def bad() -> dict:
        raise ValueError("corrupt model")

    with pool.ahead():
        with pytest.raises(ValueError, match="corrupt model"):
            pool.shared_decode(("m4", ("w",)), bad)
        assert pool.shared_decode(("m4", ("w",)), lambda: {"ok": 1}) == {"ok": 1}


def test_a_closed_pool_turns_away_agents_before_they_decode():
    pool = TrainerPool(make_task("lm", data="builtin", model="gru-tiny", clients=2, seed=0), size=1, seed=0)
    pool.close()
    with pytest.raises(PoolClosed):
        with pool.ahead():
            pass
    assert pool.shared_decode(("m", ()), lambda: {"late": 1}) == {"late": 1} and pool._decoded == {}


def test_at_most_one_client_more_than_the_trainers_holds_a_decoded_model(pool):
    inside, most, lock, full = [0], [0], threading.Lock(), threading.Event()

    def client() -> None:
        with pool.ahead():
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                if inside[0] == pool.size + 1:
                    full.set()
            full.wait(5)  # hold on until as many as may be are inside, however slowly the threads start
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == pool.size + 1


def test_waiting_agents_go_in_by_turn_not_by_arrival():
    """A synchronous round folds in name order: agents that wait for a place go in that order, whatever order
    their threads came in (so their updates arrive in turn rather than parked on the aggregator's spool). One
    place here, so that the order they go in is the order they record."""
    gate = _TurnGate(1)
    entered: list[str] = []
    names = ["agent-7", "agent-2", "agent-9", "agent-0", "agent-5", "agent-3"]

    def client(name: str) -> None:
        with gate.slot((1, name)):
            entered.append(name)

    release = threading.Event()

    def holder() -> None:  # the place taken until every other agent waits
        with gate.slot((0, "held")):
            release.wait()

    first = threading.Thread(target=holder)
    first.start()
    while not gate._waiting and gate._free:  # the holder is in
        time.sleep(0.01)
    threads = [threading.Thread(target=client, args=(n,)) for n in names]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(gate._waiting) < len(names) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(gate._waiting) == len(names)  # every client came and waits
    release.set()
    for t in [first, *threads]:
        t.join()
    assert entered == sorted(names)
    assert gate._free == 1 and not gate._waiting  # the place is back
