"""Secure aggregation's settings and messages: the job refuses in one line what cannot run on a secure sum;
every step's message survives the wire and a malformed one is refused as bad-payload; an agent too old to
mask refuses the job instead of uploading in the clear."""

from __future__ import annotations

import numpy as np
import pytest

from fedmq.aggregator.config import JobConfig
from fedmq.aggregator.job_keys import JobConfigError
from fedmq.aggregator.strategies.fedavg import FedAvg
from fedmq.aggregator.strategies.registry import client_map, strategy_class
from fedmq.broker.wire import messages
from fedmq.broker.wire.envelope import Kind
from fedmq.errors import CodecError, SecAggError
from fedmq.secagg import graph, payloads
from fedmq.secagg.masking import MaskingClient
from fedmq.secagg.messages import UnmaskRequest, UnmaskShares
from fedmq.secagg.shamir import Share


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"strategy": "fedatt"}, "needs to read each client's update"),
        ({"strategy": "fedmed"}, "needs to read each client's update"),
        ({"beta": 0.5}, "grants uploads by each client's loss"),
        ({"robust": "median"}, "strategy 'median' needs to read each client's update"),
        ({"robust": "clip:1"}, "needs to read each client's update"),
        ({"dp": "central"}, "dp (--dp) central clips each update at the aggregator: use dp (--dp) client"),
        ({"edges": 2}, "edge aggregators"),
        ({"secagg_clip": 0.0}, "secagg_clip (--secagg-clip) must be in (0"),
        ({"secagg_corrupt": 0.5}, "secagg_corrupt must be in [0, 0.5)"),
        ({"clients": 10, "fraction": 0.2}, "a cohort of 2 cannot hide one input in its sum"),
        ({"strategy": "async", "clients": 2}, "a job has at least 3 clients under it"),
        ({"strategy": "async", "clients": 20_000}, "at most 10922 clients, not 20000"),
        ({"secagg_corrupt": 0.4, "secagg_dropout": 0.4}, "a cohort of 3 cannot tolerate 1 corrupted"),
    ],
)
def test_what_cannot_run_on_a_secure_sum_is_refused_in_one_line(settings, words):
    with pytest.raises(JobConfigError) as err:
        JobConfig(secagg=True, **settings)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_secure_sums_run_the_strategies_whose_weights_a_client_knows():
    secure = {"fedavg", "fedsgd", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "scaffold"}
    assert all(strategy_class(n).secure_sum for n in secure)
    assert not strategy_class("fedavg-clip").secure_sum  # weighs by the update's norm

    class ByNorm(FedAvg):
        def weight(self, update):
            return 1.0

    assert not ByNorm.secure_sum and ByNorm.partial_sums  # a sum still, but not of weights a client knows
    JobConfig(secagg=True, strategy="fedadam")  # accepted
    JobConfig(secagg=True, strategy="async")  # secure buffers: the clients apply their staleness weight
    assert strategy_class("async").secure_sum
    JobConfig(secagg=True, dp="client")  # distributed DP: the clients noise before masking
    JobConfig(secagg=True, dp="client", strategy="async")  # a stale client tops its share up (ClientDP.weigh)


def test_a_secure_sum_of_noised_changes_is_what_client_dp_folds_one_by_one():
    import torch

    from fedmq.aggregator.strategies.base import ClientUpdate, PartialSum
    from fedmq.aggregator.strategies.registry import strategy_from_config

    cfg = JobConfig(secagg=True, dp="client", clients=10, fraction=0.5, noise_multiplier=1.0)
    g = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
    gen = torch.Generator().manual_seed(0)
    changes = [{k: 0.1 * torch.randn(v.shape, generator=gen) for k, v in g.items()} for _ in range(4)]
    _, one = strategy_from_config("fedavg", cfg)
    _, summed = strategy_from_config("fedavg", cfg)
    assert not summed.weighs_samples  # every client weighs itself by 1
    for s in (one, summed):
        s.begin(g)
    for i, c in enumerate(changes):
        one.fold(ClientUpdate(f"c{i}", 1, c, delta=True))
    total = {k: sum(c[k] for c in changes) for k in g}
    summed.fold_partial(PartialSum(total, {k: (4.0, 4.0) for k in g}, 4.0, {f"c{i}": 1.0 for i in range(4)}))
    a, b = one.finish(), summed.finish()
    for k in g:
        torch.testing.assert_close(a[k], b[k])


def test_the_round_config_carries_the_clipping_range():
    cfg = JobConfig(secagg=True, secagg_clip=2.5).round_config()
    assert messages.RoundConfig.from_payload(cfg.to_payload()).secagg_clip == 2.5
    assert "secagg_clip" not in JobConfig().round_config().to_payload()
    for bad in (-1.0, True, "1", 1e7):
        with pytest.raises(CodecError, match="secagg_clip"):
            messages.RoundConfig.from_payload({**cfg.to_payload(), "secagg_clip": bad})


def test_an_agent_too_old_to_mask_refuses_a_secure_job(monkeypatch):
    """A secure job's announcement always has a client map of the version that brought secure aggregation:
    an agent of the version before reads it, says upgrade, and leaves (it would ignore secagg_clip and upload
    its update in the clear)."""
    from fedmq.client_agent import agent as agent_module
    from fedmq.client_agent.agent import Agent, ClientHookError

    spec = client_map(JobConfig(secagg=True))
    assert spec == {"version": 5, "hooks": []} and client_map(JobConfig()) == {}
    monkeypatch.setattr(agent_module, "PROTOCOL", 2)
    with pytest.raises(ClientHookError, match="upgrade fedmq on the agents"):
        Agent._client_hooks(object.__new__(Agent), spec, 0)


def test_agents_and_aggregators_that_mask_differently_refuse_each_other(monkeypatch):
    """Version 5 of the client map brought masks expanded from 16-byte shared secrets (version 4, the PRG
    that counts from block 2: fedmq.secagg.prg): an agent of version 4 refuses a secure job of version 5, and
    an agent of version 5 refuses a secure job whose aggregator announces version 4 or 3, each in one line,
    instead of a round whose masks do not cancel."""
    from fedmq import client_map as versions
    from fedmq.client_agent import agent as agent_module
    from fedmq.client_agent.agent import Agent, ClientHookError

    spec = client_map(JobConfig(secagg=True))
    assert spec["version"] == versions.SECURE == versions.VERSION
    Agent._check_secure(spec)  # today's aggregator: taken
    for older in ({"version": 4, "hooks": []}, {"version": 3, "hooks": []}, {}, None):
        with pytest.raises(ClientHookError, match="upgrade fedmq on the aggregator"):
            Agent._check_secure(older)
    monkeypatch.setattr(agent_module, "PROTOCOL", 4)
    with pytest.raises(ClientHookError, match="upgrade fedmq on the agents"):
        Agent._client_hooks(object.__new__(Agent), spec, 0)


def _roundtrip(kind: Kind, payload: dict) -> dict:
    env = messages.secagg(kind, "job", 3, "agent-1", 2, payload)
    return messages.decode(messages.encode(env)).payload


def test_every_step_survives_the_wire_and_a_malformed_one_is_refused():
    clients = {n: MaskingClient(n, "job/round-3/v2") for n in ("a", "b", "c", "d")}
    roster = {n: c.advertise() for n, c in clients.items()}
    cohort = graph.Cohort.build(sorted(roster), graph.GraphParams(3, 2), bytes(32))
    assert (
        payloads.public_keys(_roundtrip(Kind.SECAGG_KEYS, payloads.keys_payload(roster["a"]))) == roster["a"]
    )
    back, keys = payloads.cohort(
        _roundtrip(Kind.SECAGG_COHORT, payloads.cohort_payload(cohort, roster, 30, "x", 2))
    )
    assert (
        back.members == cohort.members and keys == roster and back.neighbours("a") == cohort.neighbours("a")
    )
    shared = clients["a"].share_keys(cohort, roster)
    assert payloads.shared_keys(_roundtrip(Kind.SECAGG_SHARES, payloads.shares_payload(shared))) == shared
    y = np.arange(7, dtype=np.uint32)
    assert np.array_equal(payloads.masked(_roundtrip(Kind.MASKED, payloads.masked_payload(y))), y)
    request = UnmaskRequest(("a", "b"), ("c",))
    assert (
        payloads.unmask_request(_roundtrip(Kind.SECAGG_UNMASK, payloads.unmask_payload(request))) == request
    )
    answer = UnmaskShares({"b": Share(1, bytes(16))}, {"c": Share(2, b"\1" * 16)})
    assert payloads.unmask_shares(_roundtrip(Kind.SECAGG_ANSWER, payloads.answer_payload(answer))) == answer

    bad = [
        (Kind.SECAGG_KEYS, {"channel": b"short", "mask": bytes(32)}),
        (Kind.SECAGG_COHORT, {**payloads.cohort_payload(cohort, roster, 30, "x", 2), "members": ["a", "b"]}),
        (Kind.SECAGG_COHORT, {**payloads.cohort_payload(cohort, roster, 30, "x", 2), "bits": 33}),
        (Kind.SECAGG_SHARES, {"shares": {"b": b""}, "commitment": bytes(32)}),
        (Kind.SECAGG_INBOX, {"inboxes": {"a": {"b": 7}}, "max_samples": 3}),
        (Kind.SECAGG_INBOX, {"inboxes": {}, "max_samples": -1}),
        (Kind.MASKED, {"masked": b"\0" * 6}),
        (Kind.SECAGG_UNMASK, {"survivors": ["a", "a"], "dropped": []}),
        (Kind.SECAGG_ANSWER, {"seeds": {"b": [0, bytes(16)]}, "keys": {}}),
        (Kind.SECAGG_ANSWER, {"seeds": {}, "keys": {"c": [1, bytes(15)]}}),
    ]
    for kind, payload in bad:
        with pytest.raises(CodecError) as err:
            messages.encode(messages.secagg(kind, "job", 3, "agent-1", 2, payload))
        assert err.value.reason == "bad-payload", kind
    for wrong in (np.arange(8, dtype=np.int64), np.arange(8, dtype=np.uint32)[::2]):
        with pytest.raises(SecAggError, match="bad-length: a masked vector is one contiguous uint32"):
            payloads.masked_payload(wrong)


def test_a_masked_upload_carries_the_vector_by_reference_and_arrives_as_its_bytes():
    big = np.arange(300_000, dtype=np.uint32)  # past the size the packer keeps by reference
    payload = payloads.masked_payload(big)
    assert isinstance(payload["masked"], memoryview) and payload["masked"].obj is big
    assert np.array_equal(payloads.masked(_roundtrip(Kind.MASKED, payload)), big)


def test_a_secure_buffer_folds_what_buffered_async_folds_one_by_one():
    """The members weigh their changes by s(τ_k) n_k (the quantizer's scale), BufferedAsync's fold_partial
    applies η_g: the version is the one its fold of the same updates gives."""
    import torch

    from fedmq.aggregator.strategies.base import ClientUpdate, PartialSum
    from fedmq.aggregator.strategies.buffered_async import BufferedAsync
    from fedmq.secagg.quantize import Quantizer
    from fedmq.staleness import staleness_weight

    g = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    gen = torch.Generator().manual_seed(0)
    members = [
        (0.1 * torch.randn(15, generator=gen, dtype=torch.float64), n, tau)
        for n, tau in ((3, 0), (5, 2), (2, 1))
    ]
    one, summed = BufferedAsync(buffer_size=3, server_lr=0.7), BufferedAsync(buffer_size=3, server_lr=0.7)
    for s in (one, summed):
        s.begin(g)
    for i, (x, n, tau) in enumerate(members):
        tensors = {"b": x[:3].float(), "w": x[3:].reshape(4, 3).float()}  # the flat order: names sorted
        one.fold(ClientUpdate(f"c{i}", n, tensors, delta=True, staleness=tau))
    q, n_max = Quantizer.for_clients(3, 1.0), 5
    rng = np.random.default_rng(0)
    total = sum(q.encode_weighted(x.numpy(), n / n_max, rng, staleness_weight(tau)) for x, n, tau in members)
    mean, weight = q.decode_weighted_mean(total, 3)
    sums = {
        "b": torch.from_numpy(mean[:3] * weight * n_max),
        "w": torch.from_numpy(mean[3:].reshape(4, 3) * weight * n_max),
    }
    count = weight * n_max
    summed.fold_partial(
        PartialSum(sums, {k: (count, count) for k in g}, count, {"c0": 1.0, "c1": 1.0, "c2": 1.0})
    )
    assert summed.pending == one.pending == 3
    a, b = one.finish(), summed.finish()
    for k in g:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=3 * q.step * n_max + 1e-6)
    with pytest.raises(Exception, match="staleness weight"):
        q.encode_weighted(np.zeros(3), 1.0, rng, 0.0)


def test_a_grant_names_whom_it_releases_and_whose_check_in_it_refuses():
    for field in ("released", "refused"):
        env = messages.secagg(Kind.GRANT, "job", 3, "aggregator", 2, {"granted": [], field: ["h0-1"]})
        assert messages.decode(messages.encode(env)).payload[field] == ["h0-1"]
        for bad in ("h0-1", [1]):
            with pytest.raises(CodecError) as err:
                messages.encode(
                    messages.secagg(Kind.GRANT, "job", 3, "aggregator", 2, {"granted": [], field: bad})
                )
            assert err.value.reason == "bad-payload"


def test_a_change_is_flattened_name_by_name_in_float32_for_any_dtype_and_layout():
    """flat_change writes each difference into its place: the same vector as concatenating the per-tensor
    float32 differences in the order of their names (what the aggregator unflattens), whatever the dtype,
    layout or rank of a tensor."""
    import torch

    from fedmq.client_agent.secure_upload import flat_change

    g = torch.Generator().manual_seed(3)
    held = {
        "w": torch.randn(4, 3, generator=g).t(),  # not contiguous
        "b": torch.randn(5, generator=g).half(),
        "count": torch.tensor(7, dtype=torch.int64),  # 0-d, integer
        "a.emb": torch.randn(2, 3, 2, generator=g),
    }
    upload = {k: (v + 1 if not v.is_floating_point() else v * 1.5 + 0.25) for k, v in held.items()}
    expected = np.concatenate(
        [(upload[k].float() - held[k].float()).reshape(-1).numpy() for k in sorted(held)]
    )
    got = flat_change(upload, held)
    assert got.dtype == np.float32 and got.shape == (12 + 5 + 1 + 12,)
    assert np.array_equal(got, expected)
