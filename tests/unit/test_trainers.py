"""TrainerPool: each trainer's work runs on one thread of its own (CUDA keeps handles per thread)."""

from __future__ import annotations

import threading

import pytest

from fedmq.client_agent.trainers import TrainerPool
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
