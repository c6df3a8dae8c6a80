"""The printed limit of `fedmq bench flower` (fedmq.benchmarks.limit): its formula, and a measurement at a
tiny size that yields one limit per pair of encodings, differing only in the codec's parts."""

from __future__ import annotations

import pytest

from fedmq.benchmarks.limit import CODEC, PARTS, Limit, measure

PARTS_MS = {
    "encode_down": 30,
    "decode_down": 20,
    "train": 90,
    "encode_up": 25,
    "decode_up": 15,
    "fold": 5,
    "validate": 4,
    "checkpoint": 70,
}


def test_the_model_is_encoded_and_decoded_once_and_each_client_does_the_rest():
    limit = Limit({k: v / 1e3 for k, v in PARTS_MS.items()}, selected=10, cores=2, up="u", down="d")
    assert limit.work == pytest.approx((30 + 20 + 4 + 70 + 10 * (90 + 25 + 15 + 5)) / 1e3)
    assert limit.critical == pytest.approx((30 + 20 + 90 + 25 + 15 + 5 + 4) / 1e3)
    assert limit.seconds == pytest.approx(limit.work / 2)  # 1.475 s of work on 2 cores > the 0.189 s chain
    one_core = Limit(limit.parts, selected=1, cores=2, up="u", down="d")
    assert one_core.seconds == pytest.approx(one_core.critical)  # one client: the chain bounds the round
    assert "round limit 0.74 s" in limit.describe() and "uplink u, downlink d" in limit.describe()


def test_a_limit_for_each_pair_of_encodings_with_the_same_training_and_checkpoint():
    pairs = (("delta+bf16", "bf16"), ("raw", "raw"))
    limits = measure("builtin", clients=4, selected=2, encodings=pairs, repeats=1, model_name="gru-tiny")
    assert [(lim.up, lim.down) for lim in limits] == list(pairs)
    for lim in limits:
        assert set(lim.parts) == set(PARTS) and all(v > 0 for v in lim.parts.values())
    shared = set(PARTS) - set(CODEC)
    assert {k: limits[0].parts[k] for k in shared} == {k: limits[1].parts[k] for k in shared}
