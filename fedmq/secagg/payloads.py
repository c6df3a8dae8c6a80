"""Secure aggregation's messages on the wire: the payloads of the envelope kinds SECAGG_* and MASKED, their
shape checks (``check``, called by broker.wire.messages.check_payload for every message of these kinds) and
their conversion to and from the typed messages of the core (fedmq.secagg.messages, keys.PublicKeys).

One round of secure aggregation (aggregator.secure_round, client_agent.secure_upload):

| kind | from → to | payload |
|---|---|---|
| secagg-keys | client → aggregator (its report key) | c_u^PK, s_u^PK |
| secagg-cohort | aggregator → the selected (control queues) | members, k, t, seed, roster, bits, floor |
| secagg-shares | client → aggregator (report key) | an encrypted share pair per neighbour, a commitment |
| secagg-inbox | aggregator → the cohort | each recipient's shares; n_max for the weights |
| masked | client → aggregator (its update key) | the masked vector, uint32 little-endian |
| secagg-unmask | aggregator → the survivors | who survived, who dropped |
| secagg-answer | client → aggregator (report key) | shares of survivors' seeds and dropped clients' keys |

Everything here is checked before the core sees it: a forged or damaged message is a CodecError, one line.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedmq.errors import CodecError, SecAggError
from fedmq.secagg import prg
from fedmq.secagg.graph import SEED_BYTES, Cohort, GraphParams
from fedmq.secagg.keys import KEY_BYTES, PublicKeys
from fedmq.secagg.messages import COMMITMENT_BYTES, SharedKeys, UnmaskRequest, UnmaskShares
from fedmq.secagg.shamir import SECRET_BYTES, Share

MAX_COHORT = 100_000  # members of one cohort
# an encrypted share pair: AES-GCM nonce + (index + two 32-byte shares) + tag, with room to spare
MAX_SHARE_CIPHERTEXT = 256
MAX_SAMPLES = 2**53  # n_max, as a report's n_samples
_MAX_NAME = 64


def _name(x: object) -> bool:
    return isinstance(x, str) and 0 < len(x) <= _MAX_NAME


def _blob(x: object, size: int) -> bool:
    return isinstance(x, bytes) and len(x) == size


def _names(x: object) -> bool:
    return isinstance(x, list) and len(x) <= MAX_COHORT and all(_name(c) for c in x) and len(set(x)) == len(x)


def _ciphertexts(x: object) -> bool:
    return (
        isinstance(x, dict)
        and len(x) <= MAX_COHORT
        and all(
            _name(k) and isinstance(v, bytes) and 0 < len(v) <= MAX_SHARE_CIPHERTEXT for k, v in x.items()
        )
    )


def _shares(x: object) -> bool:
    return isinstance(x, dict) and all(
        _name(k)
        and isinstance(v, list)
        and len(v) == 2
        and type(v[0]) is int
        and 1 <= v[0] < 2**16
        and _blob(v[1], SECRET_BYTES)
        for k, v in x.items()
    )


def _cohort_ok(p: dict) -> bool:
    members, keys = p["members"], p["keys"]
    return (
        _names(members)
        and _blob(p["seed"], SEED_BYTES)
        and type(p["degree"]) is int
        and type(p["threshold"]) is int
        and type(p["bits"]) is int
        and 1 <= p["bits"] <= 32
        and 1 <= p["floor"] <= len(members)
        and 0 < len(p["context"]) <= 256
        and set(keys) == set(members)
        and all(
            isinstance(v, list) and len(v) == 2 and all(_blob(b, KEY_BYTES) for b in v) for v in keys.values()
        )
    )


FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "secagg-keys": {"channel": (bytes,), "mask": (bytes,)},
    "secagg-cohort": {
        "members": (list,),
        "degree": (int,),
        "threshold": (int,),
        "seed": (bytes,),
        "keys": (dict,),
        "bits": (int,),
        "context": (str,),
        "floor": (int,),
    },
    "secagg-shares": {"shares": (dict,), "commitment": (bytes,)},
    "secagg-inbox": {"inboxes": (dict,), "max_samples": (int,)},
    "masked": {"masked": (bytes, memoryview)},  # a memoryview on the way out (masked_payload)
    "secagg-unmask": {"survivors": (list,), "dropped": (list,)},
    "secagg-answer": {"seeds": (dict,), "keys": (dict,)},
}

_CHECKS = {
    "secagg-keys": lambda p: _blob(p["channel"], KEY_BYTES) and _blob(p["mask"], KEY_BYTES),
    "secagg-cohort": _cohort_ok,
    "secagg-shares": lambda p: _ciphertexts(p["shares"]) and _blob(p["commitment"], COMMITMENT_BYTES),
    "secagg-inbox": lambda p: (
        0 <= p["max_samples"] < MAX_SAMPLES
        and len(p["inboxes"]) <= MAX_COHORT
        and all(_name(k) and _ciphertexts(v) for k, v in p["inboxes"].items())
    ),
    "masked": lambda p: len(p["masked"]) % prg.DTYPE.itemsize == 0 and len(p["masked"]) > 0,
    "secagg-unmask": lambda p: _names(p["survivors"]) and _names(p["dropped"]),
    "secagg-answer": lambda p: _shares(p["seeds"]) and _shares(p["keys"]),
}


def context(job: str, rnd: int, version: int) -> str:
    """What names one secure sum, the same on every party: every key and encrypted share of it depends on
    it."""
    return f"{job}/round-{rnd}/v{version}"


def check(kind: str, payload: dict) -> None:
    """CodecError("bad-payload") unless ``payload`` is a well-formed message of secure aggregation ``kind``
    (its fields' types are checked by the caller, from FIELDS)."""
    if not _CHECKS[kind](payload):
        raise CodecError("bad-payload", f"{kind}: malformed (fedmq.secagg.payloads)")


# ------------------------------------------------------------------ to and from the core's types
def keys_payload(keys: PublicKeys) -> dict[str, Any]:
    return {"channel": keys.channel, "mask": keys.mask}


def public_keys(p: Mapping[str, Any]) -> PublicKeys:
    return PublicKeys(p["channel"], p["mask"])


def cohort_payload(
    cohort: Cohort, roster: Mapping[str, PublicKeys], bits: int, context: str, floor: int
) -> dict[str, Any]:
    """``floor``: the fewest survivors whose sum the aggregator may unmask (max(t, the job's min_clients));
    a client refuses to help unmask a smaller one."""
    return {
        "floor": floor,
        "members": list(cohort.members),
        "degree": cohort.params.degree,
        "threshold": cohort.params.threshold,
        "seed": cohort.seed,
        "keys": {m: [roster[m].channel, roster[m].mask] for m in cohort.members},
        "bits": bits,
        "context": context,
    }


@functools.lru_cache(maxsize=8)
def _graph(members: tuple[str, ...], degree: int, threshold: int, seed: bytes) -> Cohort:
    """Cohort.build, once for all the clients of a host that one cohort message names (a Cohort is frozen)."""
    return Cohort.build(members, GraphParams(degree, threshold), seed)


def cohort(p: Mapping[str, Any]) -> tuple[Cohort, dict[str, PublicKeys]]:
    """The cohort and roster a secagg-cohort message names (checked: ``check``); SecAggError if they cannot
    form a graph."""
    built = _graph(tuple(p["members"]), p["degree"], p["threshold"], p["seed"])
    return built, {m: PublicKeys(c, s) for m, (c, s) in p["keys"].items()}


def shares_payload(shared: SharedKeys) -> dict[str, Any]:
    return {"shares": dict(shared.ciphertexts), "commitment": shared.seed_commitment}


def shared_keys(p: Mapping[str, Any]) -> SharedKeys:
    return SharedKeys(dict(p["shares"]), p["commitment"])


def masked_payload(y: np.ndarray) -> dict[str, Any]:
    """The masked vector by reference (its bytes are copied once, into the packed message: broker.wire)."""
    if y.dtype != prg.DTYPE or y.ndim != 1 or not y.flags.c_contiguous:
        raise SecAggError("bad-length", "a masked vector is one contiguous uint32 vector")
    return {"masked": y.data.cast("B")}


def masked(p: Mapping[str, Any]) -> np.ndarray:
    """The masked vector (a read-only view of the message's bytes)."""
    return np.frombuffer(p["masked"], prg.DTYPE)


def unmask_payload(request: UnmaskRequest) -> dict[str, Any]:
    return {"survivors": list(request.survivors), "dropped": list(request.dropped)}


def unmask_request(p: Mapping[str, Any]) -> UnmaskRequest:
    return UnmaskRequest(tuple(p["survivors"]), tuple(p["dropped"]))


def answer_payload(answer: UnmaskShares) -> dict[str, Any]:
    return {
        "seeds": {v: [s.index, s.data] for v, s in answer.seeds.items()},
        "keys": {v: [s.index, s.data] for v, s in answer.keys.items()},
    }


def unmask_shares(p: Mapping[str, Any]) -> UnmaskShares:
    return UnmaskShares(
        seeds={v: Share(i, d) for v, (i, d) in p["seeds"].items()},
        keys={v: Share(i, d) for v, (i, d) in p["keys"].items()},
    )
