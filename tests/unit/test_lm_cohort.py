"""Training a round's clients together (fedmq.tasks.lm_cohort, client_agent.trainers.CohortPool): each client
ends where training it alone would have left it, up to float summation order,
in every regime the batched loop takes."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from load_factor import budget

from fedmq.client_agent.trainers import CohortPool
from fedmq.tasks.base import TrainConfig, model_state
from fedmq.tasks.errors import TaskError
from fedmq.tasks.lm_data import StreamBatches
from fedmq.tasks.registry import make_task

CLIENTS = [0, 3, 7]  # shards of different lengths: their last windows differ, and so do their window counts
REGIME = dict(epochs=2, batch_size=4, lr=0.5, momentum=0.5, lr_decay=0.9, clip=0.0)


def _task(model: str = "gru-tiny", **kw):
    return make_task(
        "lm",
        data="builtin",
        model=model,
        emb=24,
        hidden=24,
        clients=40,
        vocab_size=500,
        max_lines=2000,
        dropout=0.2,
        seed=0,
        **kw,
    )


@pytest.fixture(scope="module")
def gru():
    return _task()


def _both(task, regime: dict, clients=CLIENTS):
    """(sequential models, results), (cohort models, results), the common start, for ``regime``."""
    start = task.build_model(5)
    cfgs = [TrainConfig(**{**REGIME, **regime}, seed=100 + c) for c in clients]
    alone = [copy.deepcopy(start) for _ in clients]
    together = [copy.deepcopy(start) for _ in clients]
    ra = [task.train(m, c, cfg) for m, c, cfg in zip(alone, clients, cfgs)]
    rt = task.train_cohort(together, clients, cfgs, [None] * len(clients))
    return (alone, ra), (together, rt), start


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(model_state(a).values(), model_state(b).values()))


def test_the_chosen_clients_differ_in_windows(gru):
    windows = [
        StreamBatches.build(gru.client_ids(c), 4, gru.vocab.eos).num_windows(gru.bptt) for c in CLIENTS
    ]
    lengths = [
        StreamBatches.build(gru.client_ids(c), 4, gru.vocab.eos).inputs.size(0) % gru.bptt for c in CLIENTS
    ]
    assert len(set(windows)) > 1 and len(set(lengths)) > 1


@pytest.mark.parametrize(
    "regime",
    [
        {},  # the papers' client: SGD momentum, per-epoch lr decay, dropout, two epochs
        {"momentum": 0.0},
        {"clip": 0.05},  # clipping by each client's own gradient norm
        {
            "max_steps": 9
        },  # a step cap: a seeded start window, wrapping to the shard's start with a fresh hidden state
        {"max_steps": 30},  # the cap falls in the second epoch
        {"full_batch": True},  # FedSGD: one step on the whole shard's gradient an epoch
        {"tail_loss": True},  # FedMed: the trained model's loss on its shard
        {"tail_loss": True, "max_steps": 7},
    ],
)
def test_together_equals_alone(gru, regime):
    (alone, ra), (together, rt), start = _both(gru, regime)
    for a, t, x, y in zip(alone, together, ra, rt):
        assert _max_diff(a, start) > 0.01  # training moved the model, far beyond the tolerance below
        assert _max_diff(a, t) < 2e-5
        assert (x.steps, x.tokens, x.n_samples) == (y.steps, y.tokens, y.n_samples)
        assert y.loss == pytest.approx(x.loss, rel=1e-5)
        if regime.get("tail_loss"):
            assert y.tail_loss == pytest.approx(x.tail_loss, rel=1e-5)
        else:
            assert y.tail_loss is None


def test_lstm_untied_two_layers_together_equals_alone():
    task = _task("lstm", layers=2, tied=False)
    (alone, ra), (together, rt), start = _both(task, {"epochs": 1})
    for a, t, x, y in zip(alone, together, ra, rt):
        assert _max_diff(a, start) > 0.01 and _max_diff(a, t) < 2e-5
        assert y.loss == pytest.approx(x.loss, rel=1e-5)


def test_settings_the_batched_loop_does_not_take_train_one_after_the_other(gru):
    """Adam, or clients with different settings: exactly the sequential result (the same code path)."""
    for regime in ({"optimizer": "adam", "lr": 0.01, "max_steps": 5}, {"warmup_steps": 2, "max_steps": 5}):
        (alone, ra), (together, rt), _ = _both(gru, regime)
        assert all(_max_diff(a, t) == 0.0 for a, t in zip(alone, together)) and ra[0].loss == rt[0].loss
    start = gru.build_model(1)
    models = [copy.deepcopy(start), copy.deepcopy(start)]
    cfgs = [TrainConfig(**REGIME, max_steps=3), TrainConfig(**{**REGIME, "lr": 0.1}, max_steps=3)]
    mixed = gru.train_cohort(models, [0, 1], cfgs, [None, None])
    alone = copy.deepcopy(start)
    assert _max_diff(alone, models[1]) > 0 and mixed[1].loss == gru.train(alone, 1, cfgs[1]).loss
    assert _max_diff(alone, models[1]) == 0.0


def test_a_bad_setting_is_one_task_error(gru):
    models = [gru.build_model(0), gru.build_model(0)]
    with pytest.raises(TaskError, match=r"TrainConfig lr must be in \(0, "):
        gru.train_cohort(models, [0, 1], [TrainConfig(**{**REGIME, "lr": 0.0})] * 2, [None, None])


def test_progress_is_reported_per_client(gru):
    seen: dict[int, list[tuple[int, int]]] = {0: [], 3: []}
    models = [gru.build_model(0), gru.build_model(0)]
    cfgs = [TrainConfig(**REGIME, max_steps=4, seed=s) for s in (1, 2)]
    gru.train_cohort(models, [0, 3], cfgs, [lambda d, t, c=c: seen[c].append((d, t)) for c in (0, 3)])
    assert seen[0] == seen[3] == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_the_pool_trains_its_borrowers_together(gru):
    """Three agents borrow, load, hand in their jobs at different moments: one cohort trains them, and each
    gets the result of its own client."""
    pool = CohortPool(gru, size=3, seed=0, settle_s=0.1)
    start = gru.build_model(0)
    results: dict[int, object] = {}
    models: dict[int, torch.nn.Module] = {}
    cfg = dict(REGIME, max_steps=5)

    def agent(client: int, delay: float) -> None:
        with pool.borrow() as model:
            threading.Event().wait(delay)  # fetching and loading the global model
            model.load_state_dict(start.state_dict())
            results[client] = pool.train(model, client, TrainConfig(**cfg, seed=client))
            models[client] = copy.deepcopy(model)

    threads = [threading.Thread(target=agent, args=(c, d)) for c, d in zip(CLIENTS, (0.0, 0.3, 0.15))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=budget(60))
    assert pool.cohorts == [3]
    for c in CLIENTS:
        alone = copy.deepcopy(start)
        single = gru.train(alone, c, TrainConfig(**cfg, seed=c))
        assert _max_diff(alone, models[c]) < 2e-5 and results[c].steps == single.steps


class _SlowBuild:
    """The task, with a model that takes ``seconds`` to build (a big model on a busy machine)."""

    def __init__(self, task, seconds: float) -> None:
        self._task, self._seconds = task, seconds

    def build_model(self, seed: int = 0):
        time.sleep(self._seconds)
        return self._task.build_model(seed)

    def __getattr__(self, name: str):
        return getattr(self._task, name)


def _round_of(pool: CohortPool, agents: dict[str, int | None], selected: list[str]) -> float:
    """Round 1 on ``pool``: each agent named in ``agents`` hears the announcement of ``selected`` and trains
    its client, or (client None) drops out of the round; returns the seconds until every agent is done (a pool
    that hangs ends at pytest-timeout's limit)."""
    cfg = TrainConfig(**REGIME, max_steps=2)

    def agent(name: str, client: int | None) -> None:
        with pool.taking_part(1, selected, name):
            if client is None:
                return  # offline in this round
            with pool.borrow() as model:
                pool.train(model, client, cfg)

    threads = [threading.Thread(target=agent, args=item) for item in agents.items()]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - t0


def test_the_pool_waits_for_every_selected_agent_not_for_the_first_borrowers(gru):
    """Models that take longer to build than the settle time: the first agent's job is in long before the
    others have a model to borrow, and still the round's three train as one cohort."""
    pool = CohortPool(_SlowBuild(gru, 0.4), size=3, seed=0, settle_s=0.1)
    names = ["a", "b", "c"]
    _round_of(pool, dict(zip(names, CLIENTS)), names)
    assert pool.cohorts == [3]


def test_a_selected_agent_that_drops_out_or_never_comes_is_not_waited_for_long(gru):
    # a patience no busy machine's round reaches: a pool that waited it out took at least that long
    pool = CohortPool(gru, size=3, seed=0, settle_s=0.05, patience_s=budget(30.0))
    seconds = _round_of(pool, {"a": 0, "b": 3, "c": None}, ["a", "b", "c"])  # c: offline this round
    assert pool.cohorts == [2] and seconds < pool.patience_s, "the round waited out its patience for c"
    late = CohortPool(gru, size=3, seed=0, settle_s=0.05, patience_s=1.0)
    seconds = _round_of(late, {"a": 0, "b": 3}, ["a", "b", "d"])  # d never hears of the round
    assert late.cohorts == [2] and seconds >= 1.0


def test_a_pool_smaller_than_the_round_trains_what_it_holds_without_waiting(gru):
    """Two models, three selected agents: the third cannot borrow until the first cohort trains, so the pool
    does not wait for it (its patience: 30 s on an idle machine) and it trains alone after."""
    pool = CohortPool(gru, size=2, seed=0, settle_s=0.05, patience_s=budget(30.0))
    seconds = _round_of(pool, {"a": 0, "b": 3, "c": 7}, ["a", "b", "c"])
    assert pool.cohorts == [2, 1] and seconds < pool.patience_s, "the first cohort waited out its patience"


def test_a_failing_cohort_fails_each_of_its_jobs_and_the_pool_goes_on(gru):
    pool = CohortPool(gru, size=2, seed=0, settle_s=0.05)
    errors: list[str] = []

    def agent(client: int, lr: float) -> None:
        with pool.borrow() as model:
            try:
                pool.train(model, client, TrainConfig(**{**REGIME, "lr": lr}, max_steps=2))
            except TaskError as exc:
                errors.append(str(exc))

    threads = [threading.Thread(target=agent, args=(c, 0.0)) for c in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=budget(60))
    assert len(errors) == 2 and all("TrainConfig lr must be in (0, " in e for e in errors)
    with pool.borrow() as model:
        assert pool.train(model, 0, TrainConfig(**REGIME, max_steps=2)).steps == 2
    assert pool.cohorts == [2, 1]


def test_a_shard_shorter_than_the_batch_trains_one_after_the_other():
    task = make_task(
        "lm",
        data="builtin",
        model="gru-tiny",
        emb=16,
        hidden=16,
        clients=400,
        vocab_size=300,
        max_lines=400,
        dropout=0.2,
        seed=0,
    )
    tiny = min(range(400), key=lambda c: task.client_ids(c).numel())
    cols = task.client_ids(tiny).numel() + 1  # more columns than the shortest shard has tokens
    (alone, ra), (together, rt), _ = _both(task, {"batch_size": cols, "epochs": 1}, clients=[tiny, 0])
    assert all(_max_diff(a, t) == 0.0 for a, t in zip(alone, together)) and ra[1].loss == rt[1].loss


def test_a_cohort_larger_than_the_activation_budget_trains_in_parts(gru, monkeypatch):
    """Budget for two clients: three train as a batched pair and a lone one, each as alone."""
    from fedmq.tasks import lm_cohort

    per_client = 4 * gru.bptt * 4 * len(gru.vocab) * 4
    monkeypatch.setattr(lm_cohort, "ACTIVATION_BUDGET", 2 * per_client + 1)
    calls: list[int] = []
    real = lm_cohort.train_cohort
    monkeypatch.setattr(
        "fedmq.tasks.lm.train_cohort",
        lambda task, models, *a: calls.append(len(models)) or real(task, models, *a),
    )
    (alone, ra), (together, rt), _ = _both(gru, {"max_steps": 6})
    assert calls == [2]
    assert all(_max_diff(a, t) < 2e-5 for a, t in zip(alone, together))
    assert [r.steps for r in rt] == [r.steps for r in ra]


def test_a_closed_pool_lets_go_of_its_models_and_refuses_work(gru):
    pool = CohortPool(gru, size=1, seed=0, settle_s=0.01)
    pool.close()
    assert pool._free.empty()  # the model built for the manifest is no longer held
    with pytest.raises(RuntimeError, match="closed"):
        pool.train(gru.build_model(0), 0, TrainConfig(**REGIME, max_steps=1))
