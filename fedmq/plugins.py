"""Classes a user brings (a Task, a Strategy), named by import path ``package.module:Class`` as Flower's
``flwr run`` and uvicorn name theirs, and found on the Python path of every process that needs them."""

from __future__ import annotations

import importlib
import inspect
import re

_IMPORT_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def is_import_path(name: str) -> bool:
    """Whether ``name`` reads as ``package.module:Class`` (the built-in names never do)."""
    return bool(_IMPORT_PATH.match(name))


def load_class(path: str, base: type, what: str, error: type[Exception]) -> type:
    """The class at ``package.module:Class``, a subclass of ``base``; ``error`` (one line) when it is not."""
    if not is_import_path(path):
        raise error(f"{what} {path!r} is not an import path: want package.module:Class")
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ModuleNotFoundError, or the module itself failing to import
        raise error(f"cannot import {what} module {module_name!r}: {type(exc).__name__}: {exc}") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        found = (
            "nothing" if cls is None else type(cls).__name__ if not isinstance(cls, type) else cls.__name__
        )
        raise error(
            f"{what} {path!r} must name a subclass of {base.__module__}.{base.__name__}; found {found}"
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise error(f"{what} {path!r} does not implement {missing}")
    return cls
