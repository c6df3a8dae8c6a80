"""One round of a run: :class:`RoundRecord`, a line of the run folder's metrics.jsonl (aggregator.runlog
writes and reads them; nothing else parses the line).

``to_json`` is the line as the engine has always written it (``guard`` only when the round's guard acted), so
new lines are byte-identical to older ones and ``from_json(to_json())`` gives the record back.

``from_json`` is lenient about absence and strict about type: a key an older writer did not write gets its
neutral value (empty list or map, None, False; only ``round`` is required), but a key of the wrong type makes
the whole line malformed (:class:`MalformedRow`), since a half-trusted row would draw a wrong picture. Keys
the record does not know (another writer's, e.g. the centralized baseline's ``train_loss``) are tolerated:
they are kept in ``extra`` and written back as they were, so rewriting a line (resume) loses nothing. Numbers
are kept as JSON gave them (an integral ``valid`` stays an int) for the same reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any


class MalformedRow(ValueError):
    """A metrics line that is not a round record; the message names the first offending key."""


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RoundRecord:
    """What one round did (aggregator.engine.Engine._row). Client lists are tuples;
    the maps are plain dicts."""

    round: int
    time: float | None = None  # when the round closed (Unix seconds)
    version: int | None = None  # global model version after the round
    strategy: str | None = None  # the aggregation applied (FedMed may fall back to fedavg)
    metric: str | None = None
    valid: float | None = None  # validation score; None when not evaluated or skipped
    mean_loss: float | None = None  # mean training loss the clients reported
    online: tuple[str, ...] = ()  # the names when at most ONLINE_NAMES were online (else empty)
    online_count: int | None = None  # how many were online (None in rows of older runs: len(online))
    selected: tuple[str, ...] = ()
    reported: tuple[str, ...] = ()
    granted: tuple[str, ...] = ()
    received: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()  # expected to deliver and did not (RoundStats.dropped; none in async)
    losses: dict[str, float] = field(default_factory=dict)  # client -> reported loss
    update_ids: dict[str, str] = field(default_factory=dict)  # client -> message id of the update folded
    skipped: bool = False
    skip_reason: str | None = None
    bytes_up: int | None = None  # on the wire (compressed)
    bytes_down: int | None = None
    bytes_up_raw: int | None = None  # the same tensors as fp32
    bytes_down_raw: int | None = None
    wall_s: float | None = None
    # the aggregator's process CPU seconds during the round (under `fedmq simulate`: its agents' too)
    cpu_s: float | None = None
    weights: dict[str, float] = field(default_factory=dict)  # client -> aggregation weight
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> messages rejected so far
    dropped_msgs: dict[str, int] = field(default_factory=dict)  # reason -> messages dropped so far
    guard: dict[str, Any] | None = None  # aggregator.guards.Verdict.record(), when the round's guard acted
    # selected clients left out because the broker could not deliver to them: client -> why (only when any)
    unreachable: dict[str, str] | None = None
    # under differential privacy: ε spent after this round (None while unbounded) and its δ; only then written
    epsilon: float | None = None
    delta: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys of other writers, kept as they are

    def to_json(self) -> dict[str, Any]:
        """The metrics.jsonl object (json.dumps it with sort_keys, as the run log does)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _ONLY_WHEN_SET}
        for name in CLIENT_LISTS:
            out[name] = list(out[name])
        if self.guard is not None:
            out["guard"] = self.guard
        if self.unreachable is not None:
            out["unreachable"] = self.unreachable
        if self.online_count is not None:
            out["online_count"] = self.online_count
        if self.cpu_s is not None:  # rows of runs before it was recorded have none
            out["cpu_s"] = self.cpu_s
        if self.delta is not None:  # a DP run: ε (null while unbounded) and δ in every row
            out["epsilon"], out["delta"] = self.epsilon, self.delta
        return {**out, **self.extra}

    @classmethod
    def from_json(cls, raw: Any) -> RoundRecord:
        """The record of a parsed metrics line; :class:`MalformedRow` if it is not one
        (see the module docstring)."""
        if not isinstance(raw, dict):
            raise MalformedRow(f"a metrics row must be a JSON object, not {type(raw).__name__}")
        rnd = raw.get("round")
        if not _is_int(rnd) or rnd < 0:
            raise MalformedRow(f"metrics row: 'round' must be an integer >= 0, not {rnd!r}")
        values: dict[str, Any] = {"round": rnd}
        for key, (check, kind) in _SCALARS.items():
            value = raw.get(key)
            if value is not None and not check(value):
                _wrong(key, kind, value)
            values[key] = value
        for key in CLIENT_LISTS:
            value = raw.get(key)
            if value is not None and not (isinstance(value, list) and all(isinstance(c, str) for c in value)):
                _wrong(key, "a list of client ids", value)
            values[key] = tuple(value or ())
        for key, (check, kind) in _MAPS.items():
            value = raw.get(key)
            if value is not None and not (isinstance(value, dict) and all(check(v) for v in value.values())):
                _wrong(key, f"a map of {kind}", value)
            values[key] = dict(value or {})
        skipped = raw.get("skipped", False)
        if not isinstance(skipped, bool):
            _wrong("skipped", "true or false", skipped)
        guard = raw.get("guard")
        if guard is not None and not isinstance(guard, dict):
            _wrong("guard", "an object", guard)
        unreachable = raw.get("unreachable")
        if unreachable is not None and not (
            isinstance(unreachable, dict) and all(isinstance(v, str) for v in unreachable.values())
        ):
            _wrong("unreachable", "a map of text", unreachable)
        extra = {k: v for k, v in raw.items() if k not in _KNOWN}
        return cls(**values, skipped=skipped, guard=guard, unreachable=unreachable, extra=extra)


def _wrong(key: str, kind: str, value: Any) -> None:
    raise MalformedRow(f"metrics row: {key!r} must be {kind} or null, not {type(value).__name__}")


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


ONLINE_NAMES = 1000  # a population's names would make every row megabytes: above this, only the count
CLIENT_LISTS = ("online", "selected", "reported", "granted", "received", "dropped")  # the client-id fields
_NUMBER, _INTEGER, _TEXT = (is_number, "a number"), (_is_int, "an integer"), (_is_text, "text")
_SCALARS = {
    "time": _NUMBER,
    "version": _INTEGER,
    "strategy": _TEXT,
    "metric": _TEXT,
    "valid": _NUMBER,
    "mean_loss": _NUMBER,
    "online_count": _INTEGER,
    "skip_reason": _TEXT,
    "bytes_up": _INTEGER,
    "bytes_down": _INTEGER,
    "bytes_up_raw": _INTEGER,
    "bytes_down_raw": _INTEGER,
    "wall_s": _NUMBER,
    "cpu_s": _NUMBER,
    "epsilon": _NUMBER,
    "delta": _NUMBER,
}
_MAPS = {
    "losses": (is_number, "numbers"),
    "update_ids": (_is_text, "text"),
    "weights": (is_number, "numbers"),
    "rejected": (_is_int, "counts"),
    "dropped_msgs": (_is_int, "counts"),
}
_KNOWN = {f.name for f in fields(RoundRecord)} - {"extra"}
# keys written only when the round has them
_ONLY_WHEN_SET = ("guard", "unreachable", "online_count", "cpu_s", "epsilon", "delta", "extra")


def guard_summary(rows: Iterable[RoundRecord]) -> dict[str, int]:
    """How often the influence guard (aggregator.guards) acted over a run: the rounds it acted in, the updates
    whose weight it capped and the updates it left out (the run's summary: a departure from textbook FedAvg
    is said, not silent)."""
    acted = [r.guard for r in rows if r.guard]
    return {
        "rounds": len(acted),
        "capped": sum(len(g.get("capped") or {}) for g in acted),
        "dropped": sum(len(g.get("dropped") or {}) for g in acted),
    }


def no_round_completed(rows: Iterable[RoundRecord], rejected: Mapping[str, int]) -> str | None:
    """One line for a run that completed no round: the commonest reason its rounds were skipped and the
    updates the inbox rejected (``rejected``: reason -> count); None when a round completed. A job that made
    no progress fails (`fedmq simulate` and `aggregator run` exit 1) instead of ending like a finished one."""
    rows = list(rows)
    if any(not r.skipped for r in rows):
        return None
    reasons: dict[str, int] = {}
    for r in rows:
        reasons[r.skip_reason or "unknown"] = reasons.get(r.skip_reason or "unknown", 0) + 1
    why = max(reasons, key=lambda k: reasons[k]) if reasons else None
    line = "no round completed: " + (
        f"all {len(rows)} round(s) skipped ({reasons[why]} for {why})" if why else "no round was held"
    )
    if any(rejected.values()):
        line += "; rejected: " + ", ".join(f"{n} {reason}" for reason, n in sorted(rejected.items()) if n)
    return line
