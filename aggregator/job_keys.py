"""A job's keys as job files and run folders write them, read into JobConfig's: a job file's ``[strategy]``
and ``[privacy]`` tables, the former keys that are now a strategy's parameters (FORMER_KEYS, warned of once
per process), FedMed's former ``fedmed_js`` and the old names of the pulling strategies. Torch-free, as the
rest of a job's settings (aggregator.config, which reads its values through these)."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from fedmq.aggregator.privacy_settings import PRIVACY_TABLE
from fedmq.errors import FedmqError

log = logging.getLogger(__name__)

DEFAULT_STRATEGY = "fedavg"

# dynamic pulling (Passban et al.: DP_l, DP_g, random) was first named dp-*, which reads as differential
# privacy; the old names stay accepted (configs, run folders) and are stored under the new ones
STRATEGY_ALIASES = {"dp-l": "pull-local", "dp-g": "pull-global", "dp-random": "pull-random"}
# FedMed's JS weights were a job setting, fedmed_js, before its variants had names
# (aggregator/strategies/fedmed.py): a job file or run folder that has it is read as the strategy it ran
FEDMED_JS = {"raw": "fedmed", "relative": "fedmed-relative", "standardised": "fedmed-standardised"}


class JobConfigError(FedmqError):
    pass


class FormerKey(NamedTuple):
    """A former JobConfig key that was a built-in strategy's parameter (FORMER_KEYS)."""

    strategy: str
    param: str
    kind: str  # its type, a KINDS key
    flag: str = ""  # the simulate flag kept for it, an alias of the parameter


# the JobConfig keys that were a built-in strategy's parameters and are now its constructor's (one way in,
# one default: the constructor's, which is the value the job had). Old job files and run folders'
# config.json that hold them are still read, each as the parameter of its strategy (read_former_keys); a
# run of any other strategy ignores them, as it always did
FORMER_KEYS = {
    "att_eps": FormerKey("fedatt", "epsilon", "float", "--eps"),
    "att_norm": FormerKey("fedatt", "norm", "str", "--norm"),
    "async_k": FormerKey("async", "buffer_size", "int"),
    "max_staleness": FormerKey("async", "max_staleness", "int"),
    "server_lr": FormerKey("async", "server_lr", "float"),
}
_said: set[str] = set()  # the former keys this process has warned of (read_former_keys)


def split_strategy_table(values: dict[str, Any]) -> dict[str, Any]:
    """A job file's ``[strategy]`` table (``name = "fedadam"`` and the strategy's parameters) as the
    JobConfig keys ``strategy`` and ``strategy_args``; a plain ``strategy = "name"`` is left as it is."""
    table = values.get("strategy")
    if not isinstance(table, dict):
        return values
    args = dict(table)
    name = args.pop("name", None)
    if not isinstance(name, str):
        raise JobConfigError('the [strategy] table needs name = "STRATEGY" (e.g. name = "fedadam")')
    if "strategy_args" in values:
        raise JobConfigError(
            "give a strategy's parameters in the [strategy] table or as strategy_args, not both"
        )
    return {**values, "strategy": name, "strategy_args": args}


def split_privacy_table(values: dict[str, Any]) -> dict[str, Any]:
    """A job file's ``[privacy]`` table (``mode = "central"``, ``clip_norm``, ``noise_multiplier`` …) as the
    JobConfig fields it sets (PRIVACY_TABLE)."""
    if "privacy" not in values:
        return values
    table = values["privacy"]
    if not isinstance(table, dict):
        raise JobConfigError('privacy must be a [privacy] table (mode = "central", clip_norm = 1.0, ...)')
    unknown = sorted(k for k in table if k not in PRIVACY_TABLE)
    if unknown:
        raise JobConfigError(
            f"unknown key privacy.{unknown[0]}; the [privacy] table takes {', '.join(PRIVACY_TABLE)}"
        )
    rest = {k: v for k, v in values.items() if k != "privacy"}
    return {**rest, **{PRIVACY_TABLE[k]: v for k, v in table.items()}}


def former_key_args(strategy: str, former: dict[str, Any]) -> dict[str, Any]:
    """The parameters of ``strategy`` that the FORMER_KEYS in ``former`` set (another strategy's: none)."""
    name = STRATEGY_ALIASES.get(strategy, strategy)
    return {FORMER_KEYS[k].param: v for k, v in former.items() if FORMER_KEYS[k].strategy == name}


def with_strategy_args(values: dict[str, Any], args: dict[str, Any], where: str) -> dict[str, Any]:
    """``values`` with ``args`` added to its ``strategy_args``; a parameter given there with another value
    is refused (``where``: how ``args`` were given)."""
    given = values.get("strategy_args") or {}
    if not isinstance(given, dict):
        return values  # JobConfig names the wrong type
    clash = sorted(p for p in args if p in given and given[p] != args[p])
    if clash:
        raise JobConfigError(
            f"{where} sets {clash[0]} = {args[clash[0]]!r}, the strategy's parameters "
            f"{clash[0]} = {given[clash[0]]!r}: give it once"
        )
    return {**values, "strategy_args": {**given, **args}} if args else values


def read_former_keys(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (a job file's or config.json's keys, the strategy a name) with each of the FORMER_KEYS read
    as its strategy's parameter in ``strategy_args``, or dropped where the strategy is another. Says so once
    per process: one warning line naming the old keys and the new form."""
    former = {k: values[k] for k in FORMER_KEYS if k in values}
    if not former:
        return values
    rest = {k: v for k, v in values.items() if k not in FORMER_KEYS}
    strategy = rest.get("strategy", DEFAULT_STRATEGY)
    args = former_key_args(strategy, former) if isinstance(strategy, str) else {}
    new = sorted(k for k in former if k not in _said)
    if new:
        _said.update(new)
        forms = "; ".join(
            f"{k} -> {FORMER_KEYS[k].strategy} parameter {FORMER_KEYS[k].param} "
            f"([strategy] {FORMER_KEYS[k].param} = ..., --strategy-arg {FORMER_KEYS[k].param}=...)"
            for k in new
        )
        log.warning(
            "former job key(s), now a strategy's parameters (read as such for that strategy): %s", forms
        )
    names = ", ".join(sorted(former))
    return with_strategy_args(rest, args, names)


def named_fedmed_variant(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` without the former ``fedmed_js`` key: a ``fedmed`` job that set it to other JS weights than
    the paper's is the variant of that name (FEDMED_JS); any other strategy never read it."""
    if "fedmed_js" not in values:
        return values
    values = dict(values)
    js = values.pop("fedmed_js")
    if values.get("strategy") == "fedmed":
        if js not in FEDMED_JS:
            raise JobConfigError(
                f"unknown fedmed_js {js!r}; use the strategy fedmed-relative or fedmed-standardised"
            )
        values["strategy"] = FEDMED_JS[js]
    return values
