"""The built-in strategies' parameter names, read from their constructors' source without importing it (it
imports torch), so that a job's strategy arguments are checked by name before torch loads (aggregator.config).
Each class's ``__init__`` is found through its bases in this package; tests/unit/test_strategy_params.py
checks the result against ``inspect.signature`` of every registered class."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

_HERE = Path(__file__).parent


@dataclass(frozen=True)
class _Class:
    bases: tuple[str, ...]
    params: tuple[str, ...] | None  # its own __init__'s keyword parameters; None: it has no __init__
    takes_any: bool  # its __init__ takes **kwargs
    name: str | None  # its ``name``: the strategy it is registered as


def _base_name(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _read(node: ast.ClassDef) -> _Class:
    params: tuple[str, ...] | None = None
    takes_any, name = False, None
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            args = item.args
            params = tuple(a.arg for a in (*args.args[1:], *args.kwonlyargs))
            takes_any = args.kwarg is not None
        target: ast.expr | None = item.target if isinstance(item, ast.AnnAssign) else None
        if isinstance(item, ast.Assign) and len(item.targets) == 1:
            target = item.targets[0]
        value = getattr(item, "value", None)
        if isinstance(target, ast.Name) and target.id == "name" and isinstance(value, ast.Constant):
            name = str(value.value)
    return _Class(tuple(_base_name(b) for b in node.bases), params, takes_any, name)


@cache
def _classes() -> dict[str, _Class]:
    """Every class defined at the top of this package's modules, by class name."""
    out = {}
    for path in sorted(_HERE.glob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef):
                out[node.name] = _read(node)
    return out


def _is_strategy(name: str) -> bool:
    """Whether the class ``name`` of this package is a Strategy (a client hook may share its name)."""
    classes = _classes()
    return name == "Strategy" or any(_is_strategy(b) for b in classes[name].bases if b in classes)


def builtin_params(strategy: str) -> tuple[str, ...] | None:
    """The keyword parameters of the built-in strategy named ``strategy``, sorted; None when no built-in has
    that name or its constructor takes any keyword."""
    classes = _classes()
    found = [c for n, c in classes.items() if c.name == strategy and _is_strategy(n)]
    cls = found[0] if found else None
    while cls is not None and cls.params is None:  # the constructor it inherits
        cls = next((classes[b] for b in cls.bases if b in classes), None)
    if not found or (cls is not None and cls.takes_any):
        return None
    return tuple(sorted(cls.params or ())) if cls is not None else ()
