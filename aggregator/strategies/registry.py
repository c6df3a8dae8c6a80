"""``make_strategy(name, **params)``: the one place names and parameters become Strategy objects.

Names: fedavg, fedsgd, fedatt, fedmed, pull-local, pull-global, pull-random (all three aggregate with DynamicPull; the
name tells the agents which pulling rule to use), async, fedavg-clip, trimmed-mean, median; or a Strategy the user
brings, as ``package.module:Class`` (it runs synchronous rounds like fedavg, with its own begin/fold/finish).
Unknown names or parameters and out-of-range values raise BadParameter (a FedmqError) with one line.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from aggregator.strategies.base import Strategy
from aggregator.strategies.buffered_async import BufferedAsync
from aggregator.strategies.dynamic_pull import DynamicPull
from aggregator.strategies.fedatt import FedAtt
from aggregator.strategies.fedavg import FedAvg, FedSGD
from aggregator.strategies.fedmed import FedMed
from aggregator.strategies.robust import ClippedFedAvg, TrimmedMean
from fedmq.errors import BadParameter
from fedmq.plugins import is_import_path, load_class

_FACTORIES: dict[str, tuple[Callable[..., Strategy], dict[str, Any]]] = {
    "fedavg": (FedAvg, {}),
    "fedsgd": (FedSGD, {}),
    "fedatt": (FedAtt, {}),
    "fedmed": (FedMed, {}),
    "pull-local": (DynamicPull, {"rule": "local"}),
    "pull-global": (DynamicPull, {"rule": "global"}),
    "pull-random": (DynamicPull, {"rule": "random"}),
    "async": (BufferedAsync, {}),
    "fedavg-clip": (ClippedFedAvg, {}),
    "trimmed-mean": (TrimmedMean, {}),
    "median": (TrimmedMean, {"trim": 0.5}),
}

STRATEGY_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def make_strategy(name: str, **params: Any) -> Strategy:
    if is_import_path(name):
        return _make_own_strategy(name, params)
    if name not in _FACTORIES:
        raise BadParameter(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGY_NAMES)} "
                           "or package.module:Class")
    factory, fixed = _FACTORIES[name]
    allowed = set(inspect.signature(factory).parameters) - set(fixed)
    unknown = sorted(set(params) - allowed)
    if unknown:
        hint = f"; it accepts {', '.join(sorted(allowed))}" if allowed else "; it takes no parameters"
        raise BadParameter(f"strategy {name!r} has no parameter {unknown[0]!r}{hint}")
    return factory(**fixed, **params)


def _make_own_strategy(path: str, params: dict[str, Any]) -> Strategy:
    """A user's Strategy class; whatever its constructor raises is one BadParameter line."""
    cls = load_class(path, Strategy, "strategy", BadParameter)
    try:
        return cls(**params)
    except BadParameter:
        raise
    except Exception as exc:
        raise BadParameter(f"strategy {path!r} could not be built: {type(exc).__name__}: {exc}") from None
