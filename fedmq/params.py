"""A plug-in's parameters: keyword arguments of its constructor, checked against its signature and type hints.

Strategies and client hooks take their parameters this way, from Python, the job file's ``[strategy]`` table
or ``--strategy-arg KEY=VALUE``; ``parse_assignments`` reads the command line's form. Every mistake is one
line that names the key (BadParameter).
"""

from __future__ import annotations

import inspect
import math
import tomllib
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from fedmq.errors import BadParameter

FLAG = "--strategy-arg"
# what a parameter may hold: the values a TOML table or a command line can give
_SCALARS = (bool, int, float, str)


def bind(cls: type, args: Mapping[str, Any], what: str | None = None) -> dict[str, Any]:
    """``args`` checked against ``cls``'s constructor: every key is a parameter, every value of its annotated
    type (an int is a float; nothing else is converted), every parameter without a default is given.
    Returns the arguments to call ``cls`` with; BadParameter (one line) otherwise."""
    label = what or f"strategy {getattr(cls, 'name', cls.__name__)!r}"
    params = {
        n: p
        for n, p in inspect.signature(cls).parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    takes_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls).parameters.values())
    unknown = sorted(set(args) - set(params))
    if unknown and not takes_any:
        raise BadParameter(unknown_parameter(label, unknown[0], params))
    hints = _hints(cls)
    out: dict[str, Any] = {}
    for key, value in args.items():
        out[key] = _typed(label, key, value, hints.get(key))
    missing = sorted(n for n, p in params.items() if p.default is p.empty and n not in out)
    if missing:
        raise BadParameter(f"{label} needs parameter {missing[0]!r} ({FLAG} {missing[0]}=VALUE)")
    return out


def unknown_parameter(label: str, key: str, params: Iterable[str]) -> str:
    """The one line for a parameter ``key`` that is none of ``params``; a key that is one of them spelt
    with dashes or capitals (server-lr) is pointed at it."""
    names = sorted(params)
    hint = f"it takes {', '.join(names)}" if names else "it takes no parameters"
    meant = key.replace("-", "_").lower()
    did = f" (did you mean {meant}?)" if meant in names else ""
    return f"{label} has no parameter {key!r}{did}; {hint}"


def with_defaults(cls: type, args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` with the defaults of ``cls``'s constructor for the parameters they leave out: what it runs
    with (unchecked; ``bind`` checks)."""
    defaults = {
        n: p.default for n, p in inspect.signature(cls).parameters.items() if p.default is not p.empty
    }
    return {**defaults, **args}


def parse_assignments(items: Iterable[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings (``--strategy-arg``, repeatable) as a dict; VALUE is read as a TOML value (0.01,
    3, true, "text") and taken as a plain string when it is not one (server_lr=0.1, norm=fro)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.replace("-", "_").isidentifier():  # server-lr: the strategy names its own
            raise BadParameter(f"{FLAG} {item!r}: want KEY=VALUE, e.g. {FLAG} server_lr=0.1")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        out[key] = value
    return out


def check_values(args: Any, where: str) -> dict[str, Any]:
    """A table of parameters as a job file or JobConfig may hold it: string keys, scalar or list values."""
    if not isinstance(args, dict):
        raise BadParameter(f"{where} must be a table of parameters, got {args!r}")
    for key, value in args.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise BadParameter(f"{where}: {key!r} is not a parameter name")
        if not isinstance(value, (*_SCALARS, list)):
            raise BadParameter(f"{where}.{key} must be a number, string, boolean or list, got {value!r}")
    return dict(args)


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls.__init__)  # type: ignore[misc]  # a class's own constructor
    except Exception:  # unresolvable annotations: values are passed as they are
        return {}


def _typed(label: str, key: str, value: Any, hint: Any) -> Any:
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_args(hint) else [hint]
    if hint is None or not all(k in _SCALARS for k in kinds):
        return value
    if float in kinds and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise BadParameter(f"{label}: {key} must be finite, got {value!r}")
        return value if int in kinds and isinstance(value, int) else float(value)
    for kind in kinds:
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind in (bool, str) and isinstance(value, kind):
            return value
    words = {float: "a number", int: "a whole number", bool: "true or false", str: "a string"}
    raise BadParameter(f"{label}: {key} must be {' or '.join(words[k] for k in kinds)}, got {value!r}")
