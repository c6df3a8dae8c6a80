"""Availability models and fault plans for intermittent clients, all seeded.

A *slot* is the round an agent sees announced (sync mode) or the global model version (async mode).
``online(slot)`` is deterministic for (seed, client, slot), so a run is reproducible.

Text syntax (CLI ``--availability``):
- ``always``
- ``bernoulli:P``            online in each slot with probability P
- ``markov:A,B``             two-state chain: stay online with probability A, stay offline with probability B
                             (starts online; the stationary online share is (1-B)/(2-A-B))
- ``trace:FILE``             explicit on-line intervals per client, FedScale client_behave_trace style:
                             JSON ``{"agent-0": [[0, 5], [8, 20]], ...}`` or CSV lines ``client,start,end``
                             (half-open slot intervals ``[start, end)``;
                             a client absent from the trace is always online)

Fault syntax (CLI ``--faults``), comma separated, each drawn per selected round with its probability:
``crash-train:P`` (vanish during local training), ``crash-grant:P`` (vanish after the grant, before upload),
``slow:P:SECONDS`` (sleep before reporting), ``cut:P`` (the connection is cut without a goodbye).
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from fedmq.errors import FedmqError


class ConfigError(FedmqError):
    """A bad option value; the message says what is wrong and how to fix it."""


def _rng(seed: int, client: str, slot: int, salt: str) -> random.Random:
    return random.Random(f"{seed}/{client}/{slot}/{salt}")


class Availability:
    spec: str = "always"

    def online(self, client: str, slot: int) -> bool:
        return True


@dataclass
class Bernoulli(Availability):
    p: float
    seed: int = 0

    def online(self, client: str, slot: int) -> bool:
        return _rng(self.seed, client, slot, "bernoulli").random() < self.p


@dataclass
class Markov(Availability):
    stay_on: float
    stay_off: float
    seed: int = 0
    _cache: dict[str, list[bool]] = field(default_factory=dict, repr=False)

    def online(self, client: str, slot: int) -> bool:
        states = self._cache.setdefault(client, [True])
        while len(states) <= slot:
            u = _rng(self.seed, client, len(states), "markov").random()
            states.append(u < self.stay_on if states[-1] else u >= self.stay_off)
        return states[max(slot, 0)]


@dataclass
class Trace(Availability):
    intervals: dict[str, list[tuple[int, int]]]

    def online(self, client: str, slot: int) -> bool:
        spans = self.intervals.get(client)
        return True if spans is None else any(a <= slot < b for a, b in spans)


def _prob(text: str, what: str) -> float:
    try:
        p = float(text)
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a number; give a probability between 0 and 1") from None
    if not 0.0 <= p <= 1.0:
        raise ConfigError(f"{what}: {p} is outside [0, 1]")
    return p


def _load_trace(path: str) -> dict[str, list[tuple[int, int]]]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"trace file {path!r} not found; give trace:FILE with a JSON or CSV trace")
    out: dict[str, list[tuple[int, int]]] = {}
    try:
        if file.suffix == ".csv":
            with file.open(newline="") as fh:
                for row in csv.reader(fh):
                    if not row or row[0].startswith("#") or row[0] == "client":
                        continue
                    out.setdefault(row[0].strip(), []).append((int(row[1]), int(row[2])))
        else:
            raw = json.loads(file.read_text())
            out = {str(c): [(int(a), int(b)) for a, b in spans] for c, spans in raw.items()}
    except (ValueError, TypeError, IndexError, AttributeError) as exc:
        raise ConfigError(
            f"trace file {path!r} is malformed ({exc}); see client_agent/availability.py for the format"
        ) from None
    return out


def parse_availability(text: str, seed: int = 0) -> Availability:
    """Parse the ``--availability`` syntax; ConfigError with a one-line hint on bad input."""
    name, _, arg = text.strip().partition(":")
    if name == "always" and not arg:
        model: Availability = Availability()
    elif name == "bernoulli":
        model = Bernoulli(_prob(arg, "bernoulli:P"), seed)
    elif name == "markov":
        parts = arg.split(",")
        if len(parts) != 2:
            raise ConfigError(
                "markov needs two probabilities: markov:P_STAY_ON,P_STAY_OFF (e.g. markov:0.9,0.7)"
            )
        model = Markov(_prob(parts[0], "markov stay-on"), _prob(parts[1], "markov stay-off"), seed)
    elif name == "trace" and arg:
        model = Trace(_load_trace(arg))
    else:
        raise ConfigError(
            f"unknown availability model {text!r}; use always, bernoulli:P, markov:A,B or trace:FILE"
        )
    model.spec = text.strip()
    return model


@dataclass
class Faults:
    """Per-round fault probabilities; ``draw`` decides the faults of one (client, round), seeded."""

    crash_train: float = 0.0
    crash_grant: float = 0.0
    cut: float = 0.0
    slow: float = 0.0
    slow_seconds: float = 0.0
    seed: int = 0
    spec: str = ""

    def draw(self, client: str, rnd: int) -> set[str]:
        rng = _rng(self.seed, client, rnd, "faults")
        picked = set()
        for name, p in (
            ("crash-train", self.crash_train),
            ("crash-grant", self.crash_grant),
            ("cut", self.cut),
            ("slow", self.slow),
        ):
            if rng.random() < p:
                picked.add(name)
        return picked


def parse_faults(text: str, seed: int = 0) -> Faults:
    faults = Faults(seed=seed, spec=text.strip())
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, rest = item.partition(":")
        if name == "slow":
            p, _, secs = rest.partition(":")
            faults.slow = _prob(p, "slow:P:SECONDS")
            try:
                faults.slow_seconds = float(secs)
            except ValueError:
                raise ConfigError("slow needs a delay: slow:P:SECONDS (e.g. slow:0.1:2)") from None
        elif name in ("crash-train", "crash-grant", "cut"):
            setattr(faults, name.replace("-", "_"), _prob(rest, f"{name}:P"))
        else:
            raise ConfigError(
                f"unknown fault {item!r}; use crash-train:P, crash-grant:P, slow:P:SECONDS or cut:P"
            )
    return faults
