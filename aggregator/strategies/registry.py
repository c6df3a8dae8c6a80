"""The one place names become Strategy classes and objects.

Names: fedavg, fedsgd, fedatt, fedmed (the paper's JS weights), fedmed-relative and fedmed-standardised
(FedMed's variants: aggregator/strategies/fedmed.py), pull-local, pull-global, pull-random, async, fedavgm,
fedadagrad, fedadam, fedyogi, fedprox, scaffold, fedavg-clip, trimmed-mean, median; or a Strategy the user
brings, as ``package.module:Class`` (its ``plan`` says what its rounds are like; the default is FedAvg's
synchronous round). ``strategy_class`` looks a name up, ``strategy_from_config`` builds a round's strategy
from the job's settings, ``make_strategy`` from explicit parameters (tools and tests). Unknown names or
parameters and out-of-range values raise BadParameter (a FedmqError) with one line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fedmq.aggregator.privacy import dp_plan
from fedmq.aggregator.strategies.base import Strategy
from fedmq.aggregator.strategies.buffered_async import BufferedAsync
from fedmq.aggregator.strategies.dynamic_pull import PullGlobal, PullLocal, PullRandom
from fedmq.aggregator.strategies.fedatt import FedAtt
from fedmq.aggregator.strategies.fedavg import FedAvg, FedSGD
from fedmq.aggregator.strategies.fedavgm import FedAvgM
from fedmq.aggregator.strategies.fedmed import FedMed, FedMedRelative, FedMedStandardised
from fedmq.aggregator.strategies.fedopt import FedAdagrad, FedAdam, FedYogi
from fedmq.aggregator.strategies.fedprox import FedProx
from fedmq.aggregator.strategies.private import Private
from fedmq.aggregator.strategies.robust import ClippedFedAvg, Median, TrimmedMean
from fedmq.aggregator.strategies.scaffold import Scaffold
from fedmq.errors import BadParameter
from fedmq.hooks import PROTOCOL, ClientHook, describe, hook_path
from fedmq.params import bind
from fedmq.plugins import is_import_path, load_class
from fedmq.privacy.client_dp import ClientDP, share_std
from fedmq.upload_hooks import DynamicPulling, ErrorFeedback, Randomization

_CLASSES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        FedAvg,
        FedSGD,
        FedAtt,
        FedMed,
        FedMedRelative,
        FedMedStandardised,
        PullLocal,
        PullGlobal,
        PullRandom,
        BufferedAsync,
        FedAvgM,
        FedAdagrad,
        FedAdam,
        FedYogi,
        FedProx,
        Scaffold,
        ClippedFedAvg,
        TrimmedMean,
        Median,
    )
}
# the job's robust guard (JobConfig.robust) replaces plain FedAvg,
# also where FedMed's loss switch falls back to it
_ROBUST = {"clip": "fedavg-clip", "trimmed": "trimmed-mean", "median": "median"}

STRATEGY_NAMES: tuple[str, ...] = tuple(_CLASSES)


def strategy_class(name: str) -> type[Strategy]:
    if is_import_path(name):
        return load_class(name, Strategy, "strategy", BadParameter)
    if name not in _CLASSES:
        raise BadParameter(
            f"unknown strategy {name!r}; choose one of {', '.join(STRATEGY_NAMES)} or package.module:Class"
        )
    return _CLASSES[name]


def strategy_extras(name: str, names: list[str]) -> dict[str, str]:
    """The tensors strategy ``name`` keeps beside the model of tensors ``names``, each named to the model
    tensor it is shaped like (its client hook's extra_tensors; none without a hook)."""
    hook = strategy_class(name).client_hook
    return hook.extra_tensors(names) if hook is not None else {}


def round_strategy(name: str, cfg: Any) -> str:
    """The strategy a round named ``name`` runs: a robust guard's where the job's (JobConfig.robust) replaces
    FedAvg."""
    return _ROBUST[cfg.robust.partition(":")[0]] if name == FedAvg.name and cfg.robust != "none" else name


def strategy_from_config(name: str, cfg: Any, **extra: Any) -> tuple[str, Strategy]:
    """The strategy ``name`` built from the job's settings ``cfg`` (a JobConfig) for one round, and the name
    it runs under (a robust guard's where one replaces FedAvg); ``extra``:
    what a first pass asked for (second_pass)."""
    if cfg.strategy_args:  # they are the job's strategy's: a mistake names it as the job does
        bind(strategy_class(cfg.strategy), cfg.strategy_args, f"strategy {cfg.strategy!r}")
    name = round_strategy(name, cfg)
    cls = strategy_class(name)
    # a robust guard replacing FedAvg, or FedMed's FedAvg fallback, takes none of them
    if name != cfg.strategy and cfg.strategy_args:
        cfg = dataclasses.replace(cfg, strategy_args={})
    strategy = _built(name, lambda: cls.from_config(cfg, **extra))
    plan = dp_plan(cfg, getattr(strategy, "buffer_size", 0))
    return name, strategy if plan is None else Private(strategy, plan)


def client_hooks(cfg: Any) -> list[tuple[type[ClientHook], dict[str, Any]]]:
    """The job's client side, in the order every selected agent runs it: the strategy's own hook, then the
    upload hooks the job's settings ask for (fedmq.upload_hooks)."""
    cls = strategy_class(cfg.strategy)
    hooks: list[tuple[type[ClientHook], dict[str, Any]]] = []
    if cls.client_hook is not None:
        args = cls.client_args(bind(cls, cfg.strategy_args, f"strategy {cfg.strategy!r}"))
        hooks.append((cls.client_hook, args))
    if cfg.noise > 0:
        hooks.append((Randomization, {"sigma": float(cfg.noise)}))
    plan = dp_plan(cfg) if cfg.dp == "client" else None
    if plan is not None:  # every agent clips and adds its share of the noise (fedmq.privacy.client_dp)
        std = share_std(plan.noise_multiplier, plan.clip_norm, plan.min_count)
        hooks.append((ClientDP, {"clip_norm": plan.clip_norm, "noise_std": std}))
    if cfg.pull != "all":
        pulling = {
            "mode": cfg.pull,
            "fraction": float(cfg.pull_fraction),
            "by": cfg.pull_by,
            "down": cfg.pull_down,
        }
        hooks.append((DynamicPulling, pulling))
    if cfg.error_feedback and cfg.encoding.startswith("delta+topk"):
        hooks.append((ErrorFeedback, {}))
    return hooks


def client_map(cfg: Any) -> dict[str, Any]:
    """What every round's announcement says of the job's client side (fedmq.hooks.describe); {} for none.
    Each hook is built here once with its arguments, as every agent will build it: a parameter only the
    client side refuses fails the job before it starts, not on every agent of every round."""
    hooks = client_hooks(cfg)
    for cls, args in hooks:
        _check_hook(cfg.strategy, cls, args)
    described = describe(hooks)
    if cfg.secagg:  # fedmq.client_map.VERSION: older agents refuse it rather than upload in the clear
        described = {"hooks": [], **described, "version": PROTOCOL}
    return described


def _check_hook(strategy: str, cls: type[ClientHook], args: dict[str, Any]) -> None:
    """Build ``cls(**args)``; whatever it raises is one BadParameter line naming the strategy and the hook."""
    try:
        cls(**bind(cls, args, f"client hook {hook_path(cls)!r}"))
    except Exception as exc:
        why = str(exc).strip().splitlines() or [type(exc).__name__]
        raise BadParameter(
            f"strategy {strategy!r}: its client hook {hook_path(cls)!r} refuses its parameters: {why[0]}"
        ) from None


def make_strategy(name: str, **params: Any) -> Strategy:
    """The strategy ``name`` with explicit parameters (tools and tests), checked like a job's."""
    cls = strategy_class(name)
    bound = bind(cls, params, f"strategy {name!r}")
    return _built(name, lambda: cls(**bound))


def _built(name: str, build: Callable[[], Strategy]) -> Strategy:
    """``build()``; a refusal names the strategy (``strategy 'X': ...``), and whatever a user's strategy
    raises while being built is one BadParameter line."""
    label = f"strategy {name!r}"
    try:
        return build()
    except BadParameter as exc:
        if str(exc).startswith(label):
            raise
        raise BadParameter(f"{label}: {exc}") from None
    except Exception as exc:
        if not is_import_path(name):
            raise
        raise BadParameter(f"strategy {name!r} could not be built: {type(exc).__name__}: {exc}") from None
