"""Checks of numeric parameters (strategies, the mediator, the pulling rule): BadParameter, one line."""

from __future__ import annotations

import math
from typing import Any

from fedmq.errors import BadParameter


def check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Validate a numeric parameter; raise BadParameter with a one-line message."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadParameter(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise BadParameter(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and (value > high or (high_open and value == high)):
        raise BadParameter(f"{name} must be {'<' if high_open else '<='} {high}, got {value!r}")
    return float(value)


def check_int(name: str, value: Any, *, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BadParameter(f"{name} must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise BadParameter(f"{name} must be <= {high}, got {value!r}")
    return value
