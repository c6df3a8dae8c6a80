"""Updates and partial sums off the wire, checked against the job's manifest: what the root aggregator and
its edges (aggregator.edge) both fold."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from fedmq.aggregator.strategies.base import ClientUpdate, PartialSum, State
from fedmq.broker.wire import messages
from fedmq.broker.wire.encodings import EncodingSpec, decode_state, encode_state
from fedmq.broker.wire.envelope import Envelope
from fedmq.errors import CodecError
from fedmq.manifest import Manifest

RAW = EncodingSpec.parse("raw")  # partial sums travel exact: they are the root's own arithmetic


def decode_update(
    env: Envelope, manifest: Manifest, base: State, staleness: int = 0, n_samples: int | None = None
) -> ClientUpdate:
    """``env``'s update as a delta from ``base`` (checked against ``manifest``); ``n_samples`` replaces its
    claim (a weight the guard capped). CodecError when it does not fit."""
    tensors = decode_state(env.payload["tensors"], manifest, base, as_delta=True)
    return ClientUpdate(
        env.client,
        env.payload["n_samples"] if n_samples is None else n_samples,
        {k: torch.from_numpy(v) for k, v in tensors.items()},
        loss=env.payload["loss"],
        staleness=staleness,
        update_id=env.msg_id,
        delta=True,
    )


def partial_message(
    job: str,
    rnd: int,
    edge: str,
    version: int,
    part: PartialSum,
    clients: dict[str, list[Any]],
    failed: dict[str, str],
    nbytes: list[int] | None = None,
    guard: dict[str, dict] | None = None,
) -> Envelope:
    """An edge's partial sum of round ``rnd`` (broker.wire.messages, "partial"); ``clients``: client ->
    [loss, n_samples, update id] of each folded update (its weight comes from ``part``); ``failed``: client ->
    why it was not folded; ``guard``: the edge's guard verdict (Verdict.record)."""
    return messages.partial(
        job,
        rnd,
        edge,
        version,
        encode_state(part.sums, RAW),
        {k: [float(w), float(wb)] for k, (w, wb) in part.weights.items()},
        part.count,
        {c: [float(part.terms.get(c, 0.0)), *facts] for c, facts in clients.items()},
        failed,
        nbytes or [0, 0],
        guard or {"dropped": {}, "capped": {}},
    )


def decode_partial(env: Envelope, manifest: Manifest) -> PartialSum:
    """The partial sum a "partial" message carries, its tensors checked against ``manifest`` (CodecError)."""
    p = env.payload
    # the sums are accumulators: float32 (float64 for a float64 tensor), whatever the model's dtype
    wide = Manifest(
        tuple(replace(t, dtype="float64" if t.dtype == "float64" else "float32") for t in manifest)
    )
    sums = decode_state(p["tensors"], wide, None)
    if set(p["weights"]) != set(sums):
        raise CodecError("bad-payload", "partial: weights and tensors name different tensors")
    return PartialSum(
        {k: torch.from_numpy(v) for k, v in sums.items()},
        {k: (float(w), float(wb)) for k, (w, wb) in p["weights"].items()},
        float(p["count"]),
        {c: float(v[0]) for c, v in p["clients"].items()},
    )
