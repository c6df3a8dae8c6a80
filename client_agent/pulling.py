"""Dynamic pulling (Passban et al. 2022): which tensors a client sends (and the server pushes) this round.

For every tensor t, d_t = ‖θ_t^r − θ_t^{r−1}‖ (Frobenius norm of the change since the previous round).
Thresholds are computed separately for each group (encoder / decoder for seq2seq, "model" otherwise) with
``torch.quantile`` (linear interpolation, float64) over that group's d values, and ``fraction`` f is the
share of each group's tensors meant to travel:

* ``dp-l`` sends d_t <  quantile(d, f)       (the slowest-moving tensors)
* ``dp-g`` sends d_t >= quantile(d, 1 − f)   (the fastest-moving tensors)
* ``random`` sends, per group, as many tensors as ``dp-g`` would, chosen uniformly at random by ``rng``
* ``all`` sends everything.

With f = 0.5 both thresholds are the median and dp-l / dp-g are exact complements (the paper's rule;
the median tensor itself goes to dp-g). f = 0.33 is the "33 %" variant: about a third of each group.
Edge cases: a group of one tensor is sent by dp-g and never by dp-l; tensors with no previous value (new
tensors) are always sent; with no previous state at all (first round) everything is sent. The result is in
the order of ``current``.
"""

from __future__ import annotations

import random
from typing import Mapping

import numpy as np
import torch

from aggregator.strategies._common import check_number
from aggregator.strategies.errors import BadParameter

MODES = ("dp-l", "dp-g", "random", "all")
STRATEGY_RULES = {"dp-l": "dp-l", "dp-g": "dp-g", "dp-random": "random"}  # job strategy -> pulling mode


def tensor_changes(current: Mapping[str, torch.Tensor], previous: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """d_t for every tensor present in both states."""
    return {
        name: float(torch.dist(t.double(), previous[name].double()))
        for name, t in current.items()
        if name in previous and tuple(previous[name].shape) == tuple(t.shape)
    }


def select_tensors(
    current: Mapping[str, torch.Tensor],
    previous: Mapping[str, torch.Tensor] | None,
    groups: Mapping[str, str],
    mode: str,
    fraction: float = 0.5,
    rng: random.Random | np.random.Generator | None = None,
) -> list[str]:
    """Names of the tensors to send (see module docstring for the exact rule)."""
    if mode not in MODES:
        raise BadParameter(f"pulling mode must be one of {', '.join(MODES)}, got {mode!r}")
    f = check_number("fraction", fraction, low=0.0, high=1.0, low_open=True)
    if mode == "random" and rng is None:
        raise BadParameter("pulling mode 'random' needs an rng (random.Random or numpy Generator)")
    if mode == "all" or not previous:
        return list(current)
    d = tensor_changes(current, previous)
    chosen: set[str] = {name for name in current if name not in d}  # new tensors: always sent
    by_group: dict[str, list[str]] = {}
    for name in current:
        if name in d:
            by_group.setdefault(groups.get(name, "model"), []).append(name)
    for names in by_group.values():
        values = torch.tensor([d[n] for n in names], dtype=torch.float64)
        if mode == "dp-l":
            theta = float(torch.quantile(values, f))
            chosen.update(n for n in names if d[n] < theta)
            continue
        theta = float(torch.quantile(values, 1.0 - f))
        picked = [n for n in names if d[n] >= theta]
        if mode == "dp-g":
            chosen.update(picked)
        else:
            chosen.update(_sample(sorted(names), len(picked), rng))
    return [name for name in current if name in chosen]


def _sample(names: list[str], k: int, rng: random.Random | np.random.Generator | None) -> list[str]:
    if isinstance(rng, np.random.Generator):
        return [names[i] for i in rng.choice(len(names), size=k, replace=False)]
    if isinstance(rng, random.Random):
        return rng.sample(names, k)
    raise BadParameter(f"rng must be random.Random or numpy.random.Generator, got {type(rng).__name__}")

