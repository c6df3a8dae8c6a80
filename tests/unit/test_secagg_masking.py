"""SecAgg+'s state machines (fedmq/secagg/masking.py) driven round by round as a protocol layer would: the
unmasked sum against the plain sum, dropouts after masking, too few survivors, the uniformity of a masked
vector, tampered shares and wrong-length vectors, refusals that protect a client, fresh masks every round."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pytest
from scipy.stats import chisquare

from fedmq.errors import SecAggError
from fedmq.secagg.graph import Cohort, GraphParams, plan
from fedmq.secagg.masking import MaskingClient, MaskingServer
from fedmq.secagg.messages import SharedKeys, UnmaskRequest, UnmaskShares
from fedmq.secagg.quantize import Quantizer
from fedmq.secagg.shamir import Share

# a masked vector is judged uniform unless its top byte's chi-square p-value is below this: a truly uniform
# vector fails with probability 1e-6, and the unmasked input fails it by far (test_one_masked_vector_...)
UNIFORM_P = 1e-6


@dataclass
class Round:
    """One round or buffer run in memory: the clients, the server and their messages."""

    names: list[str]
    params: GraphParams
    length: int
    context: str = "job-1/round-1"
    silent: frozenset[str] = frozenset()  # advertise their keys, then vanish before sharing them (Round 1)
    clients: dict[str, MaskingClient] = field(init=False)
    cohort: Cohort = field(init=False)
    server: MaskingServer = field(init=False)

    def __post_init__(self) -> None:
        self.clients = {u: MaskingClient(u, self.context) for u in self.names}
        roster = {u: c.advertise() for u, c in self.clients.items()}
        self.cohort = Cohort.build(self.names, self.params, os.urandom(32))
        self.server = MaskingServer(self.cohort, roster, self.context, self.length)
        for u, c in self.clients.items():
            if u not in self.silent:
                self.server.receive_shares(u, c.share_keys(self.cohort, roster))

    def mask(self, inputs: dict[str, np.ndarray], dropped: set[str] = frozenset()) -> dict[str, np.ndarray]:
        """Every client masks; those in ``dropped`` vanish before their vector reaches the server."""
        # (mask works in place: the inputs stay the test's to compare the sum with)
        masked = {u: self.clients[u].mask(x.copy(), self.server.inbox(u)) for u, x in inputs.items()}
        for u, y in masked.items():
            if u not in dropped:
                self.server.receive_masked(u, y)
        return masked

    def unmask(self) -> np.ndarray:
        request = self.server.unmask_request()
        for u in request.survivors:
            self.server.receive_unmask(u, self.clients[u].unmask(request))
        return self.server.aggregate()


def names(m: int) -> list[str]:
    return [f"client-{i:02d}" for i in range(m)]


def quantized_inputs(q: Quantizer, members: list[str], n: int, seed: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    floats = {u: rng.uniform(-q.clip, q.clip, n).astype(np.float32) for u in members}
    return floats, {u: q.encode(x, rng) for u, x in floats.items()}


def codes_of(m: int, n: int, seed: int) -> dict[str, np.ndarray]:
    """m clients' inputs of n coordinates, quantized for a sum of m (b = 32 - ceil(log2 m), c = 1)."""
    return quantized_inputs(Quantizer.for_clients(m, 1.0), names(m), n, seed)[1]


def masked_round(m: int, n: int, params: GraphParams, seed: int) -> tuple[Round, dict, UnmaskRequest]:
    """A round whose m clients all masked their inputs, at the server's unmasking request."""
    run = Round(names(m), params, n)
    codes = codes_of(m, n, seed)
    run.mask(codes)
    return run, codes, run.server.unmask_request()


def test_the_unmasked_sum_equals_the_plain_sum_to_the_quantization_bound():
    m, n, clip = 10, 2000, 0.1
    q = Quantizer.for_clients(m, clip)  # b = 28 bits, step = 2 · 0.1 / (2^28 - 1)
    floats, codes = quantized_inputs(q, names(m), n, seed=0)
    run = Round(names(m), plan(m, 0.1, 0.3), n)
    run.mask(codes)
    total = run.unmask()
    assert np.array_equal(total, sum(codes.values()))  # exact in the ring
    plain = sum(x.astype(np.float64) for x in floats.values())
    # each of the m inputs is off by less than one step: |error| < m · 2c / (2^b - 1) ≈ 7.5e-9
    assert np.abs(q.decode_sum(total, m) - plain).max() < m * 2 * clip / (2**28 - 1)
    assert run.server.faults == []


def test_thirty_percent_dropped_after_masking_leaves_the_survivors_sum():
    m, n = 20, 1000
    codes = codes_of(m, n, seed=1)
    run = Round(names(m), plan(m, 0.1, 0.3), n)  # k = 10, t = 3
    dropped = set(names(m)[::3][:6])  # 6 of 20, spread over the ring
    run.mask(codes, dropped)
    request = run.server.unmask_request()
    assert set(request.dropped) == dropped and len(request.survivors) == 14
    total = run.unmask()
    assert np.array_equal(total, sum(codes[u] for u in request.survivors))


def test_a_client_gone_before_masking_starts_is_left_out_of_every_mask():
    m, n = 10, 300
    codes = codes_of(m, n, seed=2)
    run = Round(names(m), plan(m, 0.1, 0.3), n, context="job-1/buffer-3", silent=frozenset({"client-00"}))
    rest = {u: codes[u] for u in names(m)[1:]}
    run.mask(rest)
    assert all("client-00" not in run.server.inbox(u) for u in rest)
    assert run.server.unmask_request().dropped == ()  # nobody masked with it: nothing to rebuild
    assert np.array_equal(run.unmask(), sum(rest.values()))


def test_fewer_than_t_survivors_are_refused_in_one_line_and_nothing_returned():
    m, n = 10, 100
    run = Round(names(m), GraphParams(degree=6, threshold=4), n)
    codes = codes_of(m, n, seed=3)
    run.mask(codes, dropped=set(names(m)[3:]))  # 3 survive, 4 needed
    with pytest.raises(SecAggError) as caught:
        run.server.unmask_request()
    assert str(caught.value) == (
        "secure aggregation: too-few-survivors: 3 of 10 clients sent masked inputs, 4 needed"
    )


def test_too_few_answers_to_rebuild_a_secret_return_nothing_until_more_come():
    m, n = 10, 100
    run, codes, request = masked_round(m, n, GraphParams(degree=4, threshold=3), seed=4)
    owner = request.survivors[0]  # its seed is the first the server rebuilds
    late = run.cohort.neighbours(owner)[2:]  # 2 of its 4 neighbours answer late
    for u in request.survivors:
        if u not in late:
            run.server.receive_unmask(u, run.clients[u].unmask(request))
    with pytest.raises(SecAggError, match=f"too-few-shares: {owner}'s self-mask seed needs 3 shares, 2 came"):
        run.server.aggregate()
    run.server.receive_unmask(late[0], run.clients[late[0]].unmask(request))
    assert np.array_equal(run.server.aggregate(), sum(codes.values()))


def test_one_masked_vector_is_uniform_in_its_top_byte():
    m, n = 10, 100_000
    codes = codes_of(m, n, seed=5)
    run = Round(names(m), plan(m, 0.1, 0.3), n)
    masked = run.mask(codes)["client-04"]
    top = np.bincount(masked >> 24, minlength=256)
    assert chisquare(top).pvalue > UNIFORM_P
    # the same test rejects the input itself (its top byte is below 2^(28-24) = 16)
    assert chisquare(np.bincount(codes["client-04"] >> 24, minlength=256)).pvalue < UNIFORM_P


def test_a_share_tampered_in_transit_is_named_by_its_recipient():
    run = Round(names(6), GraphParams(degree=4, threshold=2), 50)
    inbox = run.server.inbox("client-01")
    sender = sorted(inbox)[0]
    inbox[sender] = inbox[sender][:-1] + bytes([inbox[sender][-1] ^ 0x80])
    x = np.arange(50, dtype=np.uint32)
    with pytest.raises(SecAggError, match=f"bad-ciphertext: the shares {sender} sent to client-01"):
        run.clients["client-01"].mask(x, inbox)
    assert np.array_equal(x, np.arange(50, dtype=np.uint32))  # refused before anything was masked


def test_a_client_masks_its_input_in_place():
    run = Round(names(4), GraphParams(degree=3, threshold=2), 30)
    x = np.arange(30, dtype=np.uint32)
    y = run.clients["client-00"].mask(x, run.server.inbox("client-00"))
    assert y is x and not np.array_equal(x, np.arange(30, dtype=np.uint32))


def _lying(answer: UnmaskShares, owner: str) -> UnmaskShares:
    seeds = dict(answer.seeds)
    seeds[owner] = Share(seeds[owner].index, bytes(16))
    return UnmaskShares(seeds, answer.keys)


def test_a_wrong_share_at_unmasking_is_named_and_the_sum_still_right_when_enough_remain():
    m, n = 10, 200
    run, codes, request = masked_round(m, n, GraphParams(degree=6, threshold=3), seed=6)
    owner = "client-05"
    liar = run.cohort.neighbours(owner)[0]
    for u in request.survivors:
        answer = run.clients[u].unmask(request)
        run.server.receive_unmask(u, _lying(answer, owner) if u == liar else answer)
    assert np.array_equal(run.server.aggregate(), sum(codes.values()))
    assert run.server.faults == [f"{liar}'s share of {owner}'s self-mask seed is wrong"]


def test_a_wrong_share_that_leaves_no_checkable_subset_fails_the_round_by_name():
    m, n = 6, 50
    run = Round(names(m), GraphParams(degree=2, threshold=2), n)
    run.mask({u: np.zeros(n, np.uint32) for u in names(m)})
    request = run.server.unmask_request()
    owner = "client-02"
    liar = run.cohort.neighbours(owner)[0]
    for u in request.survivors:
        answer = run.clients[u].unmask(request)
        run.server.receive_unmask(u, _lying(answer, owner) if u == liar else answer)
    holders = ", ".join(run.cohort.neighbours(owner))
    with pytest.raises(
        SecAggError, match=f"bad-share: no 2 of the shares from {holders} reconstruct {owner}'s"
    ):
        run.server.aggregate()


def test_a_wrong_length_vector_is_named_and_changes_nothing():
    m, n = 6, 40
    run = Round(names(m), GraphParams(degree=4, threshold=2), n)
    codes = codes_of(m, n, seed=7)
    masked = {u: run.clients[u].mask(codes[u].copy(), run.server.inbox(u)) for u in names(m)}
    for bad in (masked["client-03"][:-1], masked["client-03"].astype(np.int64), [1, 2, 3]):
        with pytest.raises(SecAggError, match="bad-length: client-03 sent .*, 40 uint32 expected"):
            run.server.receive_masked("client-03", bad)
    for u, y in masked.items():  # client-03 may still send its right vector: nothing was added
        run.server.receive_masked(u, y)
    assert np.array_equal(run.unmask(), sum(codes.values()))


def test_a_client_refuses_a_request_that_could_unmask_an_input():
    run = Round(names(6), GraphParams(degree=4, threshold=2), 10)
    run.mask({u: np.zeros(10, np.uint32) for u in names(6)})
    client = run.clients["client-00"]
    for request in [
        UnmaskRequest(("client-00", "client-01"), ("client-01",)),  # both secrets of client-01
        UnmaskRequest(("client-01",), ("client-00",)),  # counts the asking client as dropped
    ]:
        with pytest.raises(SecAggError, match="inconsistent-request: client-00 refuses to unmask"):
            client.unmask(request)
    with pytest.raises(
        SecAggError, match="too-few-survivors: client-00 refuses to unmask a sum of 1, 2 needed"
    ):
        client.unmask(UnmaskRequest(("client-00",), ("client-01",)))
    answer = client.unmask(UnmaskRequest(tuple(names(6)), ()))  # a consistent request is answered
    assert set(answer.seeds) == set(run.cohort.neighbours("client-00")) and answer.keys == {}
    with pytest.raises(SecAggError, match="out-of-order: client-00 answers one unmasking request"):
        client.unmask(UnmaskRequest(("client-00", "client-02", "client-03"), ("client-01",)))


def test_the_server_refuses_messages_out_of_turn_or_twice():
    run = Round(names(6), GraphParams(degree=4, threshold=2), 10)
    zeros = np.zeros(10, np.uint32)
    run.mask({u: zeros for u in names(5)})
    with pytest.raises(SecAggError, match="duplicate: a second masked vector from client-00"):
        run.server.receive_masked("client-00", zeros)
    with pytest.raises(SecAggError, match="not-a-member: masked vector from stranger"):
        run.server.receive_masked("stranger", zeros)
    run.server.unmask_request()
    with pytest.raises(SecAggError, match="out-of-order: too late in job-1/round-1 for a masked vector"):
        run.server.receive_masked("client-05", zeros)
    with pytest.raises(SecAggError, match="out-of-order: too late in job-1/round-1 for shared keys"):
        run.server.receive_shares("client-05", SharedKeys({}, bytes(32)))


def test_masks_are_fresh_every_round():
    m, n = 6, 64
    params = GraphParams(degree=4, threshold=2)
    zeros = {u: np.zeros(n, np.uint32) for u in names(m)}
    first = Round(names(m), params, n, context="job-1/round-1").mask(zeros)
    second = Round(names(m), params, n, context="job-1/round-2").mask(zeros)
    assert all(not np.array_equal(first[u], second[u]) for u in names(m))


def test_a_million_coordinates_with_dropouts():
    m, n = 10, 1_000_000
    codes = codes_of(m, n, seed=8)
    run = Round(names(m), plan(m, 0.1, 0.3), n)  # k = 6, t = 2
    dropped = {"client-01", "client-06", "client-08"}
    run.mask(codes, dropped)
    assert np.array_equal(run.unmask(), sum(codes[u] for u in names(m) if u not in dropped))


def test_a_client_outside_the_quantized_range_is_caught_in_the_sum():
    m, n = 10, 500
    codes = codes_of(m, n, seed=9)
    codes["client-07"][100] = 2**31  # beyond the 28 bits it may use: the masked vector still looks uniform
    run = Round(names(m), plan(m, 0.1, 0.3), n)
    run.mask(codes)
    total = run.unmask()
    with pytest.raises(
        SecAggError, match="out-of-range: the sum exceeds what 10 inputs of 28 bits can reach"
    ):
        Quantizer.for_clients(m, 1.0).decode_sum(total, m)
