"""Partial sums (two-tier aggregation): folding edges' partials gives one aggregator's result within float32
rounding for every strategy that has them; a partial that does not fit is refused and changes nothing; the
wire checks what a partial and an edge-round carry; a tier message from another user is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.inbox import Inbox
from fedmq.aggregator.strategies.base import ClientUpdate, PartialSum
from fedmq.aggregator.strategies.fedavg import FedAvg
from fedmq.aggregator.strategies.registry import STRATEGY_NAMES, strategy_class, strategy_from_config
from fedmq.broker.transport import topology
from fedmq.broker.transport.connect import connect
from fedmq.broker.wire import messages
from fedmq.broker.wire.encodings import EncodingSpec, encode_state
from fedmq.errors import CodecError, FedmqError, StrategyError

SHAPES = {"w": (4, 3), "b": (3,)}


def _global() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def _updates(n: int = 12) -> list[ClientUpdate]:
    gen = torch.Generator().manual_seed(1)
    return [
        ClientUpdate(
            f"c{i}",
            1 + i % 5,
            {k: 0.1 * torch.randn(s, generator=gen) for k, s in SHAPES.items()},
            delta=True,
        )
        for i in range(n)
    ]


def _cfg(strategy: str, **extra) -> JobConfig:
    return JobConfig(strategy=strategy, **extra)


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [
        ("fedavg", {}),
        ("fedsgd", {}),
        ("fedprox", {}),
        ("fedavgm", {}),
        ("fedadam", {}),
        ("fedyogi", {}),
        ("fedadagrad", {}),
        ("fedavg", {"robust": "clip:0.3"}),
    ],
)
def test_partials_of_three_edges_give_one_aggregators_result_within_float32(strategy, extra):
    cfg, g, updates = _cfg(strategy, **extra), _global(), _updates()
    _, one = strategy_from_config(strategy, cfg)
    one.begin(g)
    for u in updates:
        one.fold(u)
    expected = one.finish()
    _, root = strategy_from_config(strategy, cfg)
    root.begin(g)
    for edge in range(3):
        _, part = strategy_from_config(strategy, cfg)
        part.begin(g)
        for u in updates[edge::3]:
            part.fold(u)
        root.fold_partial(part.partial())
    got = root.finish()
    for k in SHAPES:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-6, atol=1e-7)
    assert root.client_weights().keys() == one.client_weights().keys()


def _part(**change) -> PartialSum:
    edge = FedAvg()
    edge.begin(_global())
    for u in _updates(4):
        edge.fold(u)
    return dataclasses.replace(edge.partial(), **change)


@pytest.mark.parametrize(
    "change",
    [
        {"sums": {"w": torch.zeros(4, 3), "b": torch.zeros(2)}},  # misshaped
        {"sums": {"w": torch.full((4, 3), float("nan")), "b": torch.zeros(3)}},  # not finite
        {"sums": {"w": torch.zeros(4, 3), "x": torch.zeros(3)}},  # not the model's
        {"count": -1.0},
        {"weights": {"w": (1.0, 1.0)}},  # a tensor without its weights
    ],
)
def test_a_partial_that_does_not_fit_is_refused_and_changes_nothing(change):
    g = _global()
    clean = FedAvg()
    clean.begin(g)
    clean.fold_partial(_part())
    expected = clean.finish()
    root = FedAvg()
    root.begin(g)
    root.fold_partial(_part())
    with pytest.raises(StrategyError):
        root.fold_partial(_part(**change, terms={"other": 1.0}))
    got = root.finish()
    assert all(torch.equal(got[k], expected[k]) for k in SHAPES)


def test_the_same_client_in_two_partials_is_refused():
    root = FedAvg()
    root.begin(_global())
    root.fold_partial(_part())
    with pytest.raises(StrategyError, match="twice"):
        root.fold_partial(_part())


def test_only_strategies_that_fold_as_fedavg_claim_partial_sums():
    for name in STRATEGY_NAMES:
        cls = strategy_class(name)
        if cls.partial_sums:
            assert issubclass(cls, FedAvg) and cls.fold is FedAvg.fold, name
        else:
            with pytest.raises(NotImplementedError):
                cls.partial(object.__new__(cls))  # type: ignore[arg-type]


def _entry() -> dict:
    env = messages.model("j", 1, encode_state(_global(), EncodingSpec.parse("raw")))
    return messages.model_entry(env, 1.0, 10)


NO_GUARD = {"dropped": {}, "capped": {}}


def _partial(**change) -> messages.Envelope:
    fields = {
        "tensors": {},
        "weights": {},
        "count": 1.0,
        "clients": {"c": [1.0, 0.5, 3, "id"]},
        "failed": {"d": "wrong-base"},
        "nbytes": [1, 2],
        "guard": NO_GUARD,
    }
    fields.update(change)
    return messages.partial("j", 1, "e0", 0, **fields)


@pytest.mark.parametrize(
    "env",
    [
        messages.edge_round("j", 1, 0, ["c1"], 0.0, "fedavg", {}),
        messages.edge_round("j", 1, 0, [1], 10.0, "fedavg", {}),
        _partial(weights={"w": [1.0]}),
        _partial(weights={"w": [-1.0, 0.0]}),
        _partial(count=float("nan")),
        _partial(clients={"c": [1.0, 0.5, 0, "id"]}),
        _partial(nbytes=[0]),
        _partial(failed={"d": 1}),
        _partial(guard={"dropped": {}}),
        _partial(guard={"dropped": {}, "capped": {"c": 0}}),
    ],
)
def test_the_wire_refuses_a_malformed_edge_round_or_partial(env):
    with pytest.raises(CodecError) as err:
        messages.encode(env)
    assert err.value.reason == "bad-payload"


def test_an_edge_round_naming_a_client_twice_is_refused():
    with pytest.raises(CodecError):
        messages.encode(messages.edge_round("j", 1, 0, ["c1", "c1"], 10.0, "fedavg", _entry()))


def test_a_well_formed_edge_round_and_partial_pass_and_round_configs_carry_edges():
    messages.encode(messages.edge_round("j", 1, 0, ["c1"], 10.0, "fedavg", _entry()))
    messages.encode(_partial(guard={"dropped": {"x": "norm"}, "capped": {"y": 4}}))
    cfg = JobConfig(edges=3).round_config()
    assert messages.RoundConfig.from_payload(cfg.to_payload()).edges == 3
    with pytest.raises(CodecError):
        messages.RoundConfig.from_payload({**cfg.to_payload(), "edges": -1})


@pytest.mark.parametrize(
    ("settings", "words"),
    [({"edges": -1}, "edges"), ({"edges": 2, "dp": "central"}, "dp")],
)
def test_edges_settings_that_cannot_run_are_one_line(settings, words):
    with pytest.raises(FedmqError) as err:
        JobConfig(**settings)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_edges_spread_clients_evenly_and_stably():
    clients = [f"h{h}-{i}" for h in range(4) for i in range(2500)]
    counts = [0] * 4
    for c in clients:
        counts[topology.edge_of(c, 4)] += 1
    assert min(counts) > 2300 and topology.edge_of("agent-7", 4) == topology.edge_of("agent-7", 4)


def test_a_partial_from_another_user_than_the_aggregators_is_refused():
    url = "memory://partial-identity"
    root = connect(url, user=topology.AGGREGATOR_USER)
    root.declare_job("pj", [])
    inbox = Inbox(root, "pj", "shared:guest")
    inbox.subscribe(topology.q_inbox("pj"))
    env = messages.partial("pj", 1, "e0", 0, {}, {}, 1.0, {}, {}, [0, 0], NO_GUARD)
    intruder = connect(url, user="guest")
    intruder.publish(topology.rk_partial("pj", 0), messages.encode(env))
    root.publish(topology.rk_partial("pj", 0), messages.encode(env))
    got = inbox.next(5.0) or inbox.next(5.0)  # the intruder's is rejected on the way (next gives None)
    assert got is not None and got.env.kind is messages.Kind.PARTIAL
    assert inbox.rejected["identity-mismatch"] == 1


def test_a_fedavg_subclass_that_folds_otherwise_or_twice_has_no_partial_sums_unless_it_says_so():
    class Folds(FedAvg):
        def fold(self, update: ClientUpdate) -> None:
            super().fold(update)

    class Twice(FedAvg):
        def second_pass(self, exclude: frozenset[str] = frozenset()) -> dict | None:
            return None

    class Says(Folds):
        partial_sums = True

    class Weighs(FedAvg):  # a weight of its own: still a sum
        def weight(self, update: ClientUpdate) -> float:
            return 1.0

    assert not Folds.partial_sums and not Twice.partial_sums
    assert Says.partial_sums and Weighs.partial_sums


def test_a_half_precision_models_partial_decodes_against_float32_sums():
    from fedmq.aggregator.decoding import decode_partial, partial_message
    from fedmq.manifest import Manifest

    half = {k: v.half() for k, v in _global().items()}
    edge = FedAvg()
    edge.begin(half)
    edge.fold(ClientUpdate("c0", 2, {k: 0.1 * torch.ones(s) for k, s in SHAPES.items()}, delta=True))
    env = partial_message("j", 1, "e0", 0, edge.partial(), {"c0": [0.5, 2, "id"]}, {})
    part = decode_partial(messages.decode(messages.encode(env)), Manifest.from_arrays(half))
    assert part.sums["w"].dtype == torch.float32 and part.terms == {"c0": 2.0}
