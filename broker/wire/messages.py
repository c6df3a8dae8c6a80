"""The fedmq protocol: what each message kind carries, and strict validation of received payloads.

Every message is an Envelope (broker/wire/envelope.py); this module fixes the payload of each kind:

- presence  agent -> inbox   {"state": "online"|"offline", "holds": model version held (-1 none)}; from a
            host (one process serving clients ``<host>-<n>``; envelope.client the host) also "clients": the
            n it serves, as [[start, stop], ...] ranges, in every beat (a few bytes however many clients: a
            restarted aggregator learns them from the next beat); offline: the host left with all of them. A
            hosted client's own changes (offline, back online) are plain presence messages for it, sent by its
            host
- model     aggregator -> the job's model stream, once per version and form (not per agent)
            {"tensors": encoded state, "base_version": version the tensors are a delta against, or -1 for full
             weights, "partial": true when the tensors are a subset the agent lays over its own values}
- announce  aggregator -> each selected agent's latest queue (async mode: global, every agent's), small: it
            carries no tensors
            {"selected": [ids], "config": RoundConfig (below), "mode": "sync"|"async",
             "models": [{"id": model message id, "base_version": int, "partial": bool, "since": POSIX time it
             was published (where a reader starts in the stream), "bytes": its size}], and, when the strategy
             has a client side, "client": {"version": 2, "hooks": [{"hook": package.module:Class,
             "hook_version": int, "args": {...}}, ...]} (fedmq.hooks)}. "models" are the forms of the
             announced version (envelope.model_version) a selected agent can fetch; it takes the smallest it
             can apply and fetches nothing when it already holds that version. Keys an agent does not know it
             ignores
- report    agent -> inbox   {"loss": float, "n_samples": int}
- grant     aggregator -> each selected agent's control queue   {"granted": [ids]}; an empty grant ends the
            round for whoever still waits in it, or, with "released": [ids], for those clients only (a
            secure asynchronous buffer's end); with "refused": [message ids], it tells the clients that
            sent those check-ins that they were not taken (aggregator.secure_buffers)
- update    agent -> inbox   {"loss": float, "n_samples": int, "tensors": encoded state}
            envelope.model_version is the global version the agent trained from.
- end       aggregator -> every agent's control queue, once, when the job has run all its rounds
            {"rounds": rounds completed}: agents leave (a stopped or crashed aggregator sends none: the job
             goes on when it restarts)

Two-tier aggregation (docs/guide/edges.md): a selected agent sends its update to its edge aggregator
(the round config's ``edges``, topology.edge_of), not the inbox, and

- edge-round  root -> one edge's queue, once the round's uploads are known (after the announce, or the grant;
            again, with fewer clients, when some of its clients went offline)
            {"clients": the round's selected clients routed to this edge, "deadline_s": seconds it waits for
             them, "strategy": the round's strategy, "model": the announced version's exact form (an
             announce models entry)}
- partial   edge -> inbox   what the edge folded of a round (aggregator.strategies.base.PartialSum):
            {"tensors": the sums, raw, "weights": {tensor: [Σ w, Σ w of delta terms]}, "count": the
             denominator's count, "clients": {client: [w, loss, n_samples, update msg id]}, "failed":
             {client: why its update was not folded}, "bytes": [wire bytes, raw bytes] of the folded
             updates, "guard": the edge's guard verdict {"dropped": {client: why}, "capped": {client: n}}}
             envelope.client is the edge's name (e<i>)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fedmq import client_map, train_config
from fedmq.broker.wire.encodings import EncodingSpec
from fedmq.broker.wire.envelope import Envelope, Kind, Limits, pack, unpack
from fedmq.errors import CodecError
from fedmq.secagg import payloads
from fedmq.train_config import TrainConfig

NO_VERSION = -1
MAX_EDGES = 4096  # edge aggregators of one job
MAX_SECAGG_CLIP = 1e6  # a secure sum's clipping range c: coordinates of an update within [-c, c]

_FIELDS: dict[Kind, dict[str, tuple[type, ...]]] = {
    Kind.PRESENCE: {"state": (str,), "holds": (int,)},
    Kind.ANNOUNCE: {"selected": (list,), "config": (dict,), "models": (list,), "mode": (str,)},
    Kind.MODEL: {"tensors": (dict,), "base_version": (int,), "partial": (bool,)},
    Kind.REPORT: {"loss": (float, int), "n_samples": (int,)},
    Kind.GRANT: {"granted": (list,)},
    Kind.UPDATE: {"loss": (float, int), "n_samples": (int,), "tensors": (dict,)},
    Kind.END: {"rounds": (int,)},
    Kind.EDGE_ROUND: {"clients": (list,), "deadline_s": (float, int), "strategy": (str,), "model": (dict,)},
    Kind.PARTIAL: {
        "tensors": (dict,),
        "weights": (dict,),
        "count": (float, int),
        "clients": (dict,),
        "failed": (dict,),
        "bytes": (list,),
        "guard": (dict,),
    },
}
_FIELDS.update({Kind(kind): fields for kind, fields in payloads.FIELDS.items()})
MAX_DEADLINE_S = 7 * 24 * 3600.0  # an edge-round's wait: a week at most


@dataclass(frozen=True)
class RoundConfig:
    """What a selected agent is told to do in a round: the announce's "config". The aggregator builds it
    (aggregator.config.JobConfig.round_config; the local training shaped by the strategy's configure_train);
    the agent reads it after ``from_payload`` has checked every field, so a forged or damaged announce is
    rejected as bad-payload instead of failing half-way through a round (or training for 10⁹ epochs). Keys it
    does not know are ignored: an older agent keeps working with a newer aggregator's additions."""

    # local training: the task's TrainConfig, whole (the agent sets its device and derives its seed from the
    # announced one, its id and the round)
    train: TrainConfig
    encoding: str  # the upload's encoding (broker.wire.encodings.EncodingSpec syntax)
    grant: bool  # wait for a grant after reporting before uploading
    keep_model: bool  # keep the model trained from: the base of delta pushes, and pull-down's values
    edges: int = 0  # two-tier aggregation: upload to edge topology.edge_of(client, edges); 0: to the inbox
    # secure aggregation: the clipping range c of every coordinate of the update (fedmq.secagg.quantize); the
    # client masks its update (client_agent.secure_upload) instead of uploading it. 0: off
    secagg_clip: float = 0.0

    def to_payload(self) -> dict[str, Any]:
        payload = {
            "train": train_config.to_payload(self.train),
            "encoding": self.encoding,
            "grant": self.grant,
            "keep_model": self.keep_model,
        }
        if self.edges:
            payload["edges"] = self.edges
        if self.secagg_clip:
            payload["secagg_clip"] = self.secagg_clip
        return payload

    @classmethod
    def from_payload(cls, payload: Any) -> RoundConfig:
        """The round config an announce carries; CodecError("bad-payload") unless every field is there, of its
        type and in its range."""
        if isinstance(payload, dict) and "train" not in payload and "epochs" in payload:
            raise CodecError(
                "bad-payload", "announce config of an older fedmq (no train map): upgrade the aggregator"
            )
        if not isinstance(payload, dict) or not {"train", "encoding", "grant", "keep_model"} <= set(payload):
            raise CodecError("bad-payload", "announce config must have train, encoding, grant and keep_model")
        try:
            train = train_config.from_payload(payload["train"])
        except ValueError as exc:
            raise CodecError("bad-payload", f"announce config: {exc}") from None
        for name in ("grant", "keep_model"):
            if type(payload[name]) is not bool:
                raise CodecError("bad-payload", f"announce config: {name} must be true or false")
        try:
            EncodingSpec.parse(payload["encoding"])
        except (CodecError, TypeError, AttributeError) as exc:
            raise CodecError("bad-payload", f"announce config: encoding: {exc}") from None
        edges = payload.get("edges", 0)
        if type(edges) is not int or not 0 <= edges <= MAX_EDGES:
            raise CodecError("bad-payload", f"announce config: edges must be whole, in [0, {MAX_EDGES}]")
        clip = payload.get("secagg_clip", 0.0)
        if type(clip) not in (int, float) or not 0 <= clip <= MAX_SECAGG_CLIP:
            why = f"announce config: secagg_clip must be in [0, {MAX_SECAGG_CLIP:g}]"
            raise CodecError("bad-payload", why)
        return cls(train, payload["encoding"], payload["grant"], payload["keep_model"], edges, float(clip))


def check_payload(env: Envelope) -> Envelope:
    """Raise CodecError("bad-payload") unless the payload has the fields and types its kind requires."""
    fields = _FIELDS[env.kind]
    payload = env.payload
    for name, types in fields.items():
        value = payload.get(name)
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise CodecError("bad-payload", f"{env.kind.value} needs {name!r} of type {types[0].__name__}")
    if env.round < -1 or env.model_version < -1:
        raise CodecError("bad-payload", "negative round or model version")
    if "loss" in fields and not math.isfinite(float(payload["loss"])):
        raise CodecError("bad-payload", "loss is not finite")
    if "n_samples" in fields and not 0 < payload["n_samples"] < 2**53:
        raise CodecError("bad-payload", "n_samples must be a positive integer")
    if env.kind is Kind.PRESENCE and payload["state"] not in ("online", "offline"):
        raise CodecError("bad-payload", "presence state must be online or offline")
    if env.kind is Kind.PRESENCE and "clients" in payload and not _roster_ok(payload["clients"]):
        raise CodecError(
            "bad-payload", f"host presence clients must be at most {MAX_ROSTER_RANGES} [start, stop] ranges"
        )
    for name in ("selected", "granted"):
        if name in fields and not all(isinstance(c, str) for c in payload[name]):
            raise CodecError("bad-payload", f"{name} must be a list of client ids")
    for name in ("released", "refused"):
        named = payload.get(name, []) if env.kind is Kind.GRANT else []
        if not (isinstance(named, list) and all(isinstance(c, str) for c in named)):
            raise CodecError("bad-payload", f"{name} must be a list of client ids")
    if env.kind is Kind.ANNOUNCE:
        if payload["mode"] not in ("sync", "async"):
            raise CodecError("bad-payload", "announce mode must be sync or async")
        RoundConfig.from_payload(payload["config"])
        for entry in payload["models"]:
            if not _model_entry_ok(entry):
                raise CodecError(
                    "bad-payload", "announce models must be {id, base_version, partial, since, bytes}"
                )
        if "client" in payload and not client_map.shape_ok(payload["client"]):
            raise CodecError(
                "bad-payload", "announce client must be {version, hooks: [{hook, hook_version, args}]}"
            )
    if env.kind is Kind.EDGE_ROUND and not _edge_round_ok(payload):
        raise CodecError(
            "bad-payload", "edge-round needs client ids, a deadline in (0, a week] and a model entry"
        )
    if env.kind.value in payloads.FIELDS:
        payloads.check(env.kind.value, payload)
    if env.kind is Kind.PARTIAL and not _partial_ok(payload):
        raise CodecError(
            "bad-payload", "partial needs [w, w_delta] per tensor, a count, [w, loss, n, id] per client"
        )
    return env


def _edge_round_ok(p: dict) -> bool:
    d = p["deadline_s"]
    return (
        all(isinstance(c, str) for c in p["clients"])
        and len(set(p["clients"])) == len(p["clients"])
        and type(d) in (int, float)
        and 0 < d <= MAX_DEADLINE_S
        and _model_entry_ok(p["model"])
    )


def _partial_ok(p: dict) -> bool:
    def number(x: object) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0

    def client_ok(v: object) -> bool:
        return (
            isinstance(v, list)
            and len(v) == 4
            and number(v[0])
            and type(v[1]) in (int, float)
            and math.isfinite(v[1])
            and type(v[2]) is int
            and 0 < v[2] < 2**53
            and isinstance(v[3], str)
        )

    return (
        all(isinstance(k, str) and isinstance(w, list) and len(w) == 2 for k, w in p["weights"].items())
        and all(number(x) for w in p["weights"].values() for x in w)
        and number(p["count"])
        and all(isinstance(c, str) and client_ok(v) for c, v in p["clients"].items())
        and all(isinstance(c, str) and isinstance(why, str) for c, why in p["failed"].items())
        and len(p["bytes"]) == 2
        and all(type(x) is int and x >= 0 for x in p["bytes"])
        and set(p["guard"]) == {"dropped", "capped"}
        and isinstance(p["guard"]["dropped"], dict)
        and isinstance(p["guard"]["capped"], dict)
        and all(isinstance(c, str) and isinstance(w, str) for c, w in p["guard"]["dropped"].items())
        and all(isinstance(c, str) and type(n) is int and n > 0 for c, n in p["guard"]["capped"].items())
    )


def _roster_ok(clients: object) -> bool:
    if not isinstance(clients, list) or len(clients) > MAX_ROSTER_RANGES:
        return False
    return all(
        isinstance(r, list)
        and len(r) == 2
        and type(r[0]) is int
        and type(r[1]) is int
        and 0 <= r[0] < r[1] <= MAX_CLIENT_INDEX
        for r in clients
    )


def _model_entry_ok(entry: object) -> bool:
    if not isinstance(entry, dict) or set(entry) != {"id", "base_version", "partial", "since", "bytes"}:
        return False
    return (
        isinstance(entry["id"], str)
        and 0 < len(entry["id"]) <= 128
        and type(entry["base_version"]) is int
        and entry["base_version"] >= -1
        and type(entry["partial"]) is bool
        and type(entry["since"]) in (int, float)
        and math.isfinite(entry["since"])
        and type(entry["bytes"]) is int
        and entry["bytes"] >= 0
    )


def decode(body: bytes, *, limits: Limits | None = None) -> Envelope:
    """Unpack and validate a message body; CodecError on anything malformed."""
    env = unpack(body, limits=limits) if limits is not None else unpack(body)
    return check_payload(env)


def encode(env: Envelope, *, level: int = 3) -> bytes:
    return pack(check_payload(env), level=level)


def presence(job: str, client: str, state: str, holds: int) -> Envelope:
    return Envelope(Kind.PRESENCE, job, NO_VERSION, client, holds, {"state": state, "holds": holds})


MAX_ROSTER_RANGES = 10_000
MAX_CLIENT_INDEX = 2**40


def host_presence(job: str, host: str, state: str, clients: list[tuple[int, int]]) -> Envelope:
    """A host's presence: the clients it serves, as [start, stop) ranges of their numbers."""
    payload = {"state": state, "holds": NO_VERSION, "clients": [[lo, hi] for lo, hi in clients]}
    return Envelope(Kind.PRESENCE, job, NO_VERSION, host, NO_VERSION, payload)


def model(
    job: str, version: int, tensors: dict, base_version: int = NO_VERSION, partial: bool = False
) -> Envelope:
    payload = {"tensors": tensors, "base_version": base_version, "partial": partial}
    return Envelope(Kind.MODEL, job, NO_VERSION, "aggregator", version, payload)


def model_entry(env: Envelope, since: float, nbytes: int) -> dict[str, Any]:
    """What an announce says of one published model message (see the module docstring)."""
    p = env.payload
    return {
        "id": env.msg_id,
        "base_version": p["base_version"],
        "partial": p["partial"],
        "since": float(since),
        "bytes": int(nbytes),
    }


def announce(
    job: str,
    rnd: int,
    version: int,
    selected: list[str],
    config: RoundConfig,
    models: list[dict[str, Any]],
    mode: str = "sync",
    client: dict[str, Any] | None = None,
) -> Envelope:
    payload = {"selected": selected, "config": config.to_payload(), "models": models, "mode": mode}
    if client:
        payload["client"] = client
    return Envelope(Kind.ANNOUNCE, job, rnd, "aggregator", version, payload)


def report(job: str, rnd: int, client: str, version: int, loss: float, n_samples: int) -> Envelope:
    return Envelope(
        Kind.REPORT, job, rnd, client, version, {"loss": float(loss), "n_samples": int(n_samples)}
    )


def grant(job: str, rnd: int, version: int, granted: list[str]) -> Envelope:
    return Envelope(Kind.GRANT, job, rnd, "aggregator", version, {"granted": granted})


def update(
    job: str, rnd: int, client: str, version: int, loss: float, n_samples: int, tensors: dict
) -> Envelope:
    payload = {"loss": float(loss), "n_samples": int(n_samples), "tensors": tensors}
    return Envelope(Kind.UPDATE, job, rnd, client, version, payload)


def edge_round(
    job: str, rnd: int, version: int, clients: list[str], deadline_s: float, strategy: str, model: dict
) -> Envelope:
    payload = {"clients": clients, "deadline_s": float(deadline_s), "strategy": strategy, "model": model}
    return Envelope(Kind.EDGE_ROUND, job, rnd, "aggregator", version, payload)


def partial(
    job: str,
    rnd: int,
    edge: str,
    version: int,
    tensors: dict,
    weights: dict[str, list[float]],
    count: float,
    clients: dict[str, list[Any]],
    failed: dict[str, str],
    nbytes: list[int],
    guard: dict[str, dict],
) -> Envelope:
    payload = {
        "tensors": tensors,
        "weights": weights,
        "count": float(count),
        "clients": clients,
        "failed": failed,
        "bytes": nbytes,
        "guard": guard,
    }
    return Envelope(Kind.PARTIAL, job, rnd, edge, version, payload)


def secagg(kind: Kind, job: str, rnd: int, sender: str, version: int, payload: dict[str, Any]) -> Envelope:
    """A message of secure aggregation (fedmq.secagg.payloads builds its payload); ``sender``: the client, or
    "aggregator"."""
    return Envelope(kind, job, rnd, sender, version, payload)


def end(job: str, version: int, rounds: int) -> Envelope:
    return Envelope(Kind.END, job, NO_VERSION, "aggregator", version, {"rounds": int(rounds)})
