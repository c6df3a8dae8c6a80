"""Dynamic pulling (Passban et al. 2022): which tensors a client sends (and the server pushes) this round.

For every tensor t, d_t = ‖θ_t^r − θ_t^{r−1}‖ (Frobenius norm of the change since the previous round).
Thresholds are computed separately for each group (encoder / decoder for seq2seq, "model" otherwise), and
``fraction`` f is the share of each group meant to travel. By default (``by="params"``) it is a share of the
group's *parameters*, as in the paper ("DP_l exchanges 22,863,104 of 45,724,160 parameters"; random exchanges
"the same number of parameters"; the 33 % variant "only accepts 33 % of the parameters"): with the group's
tensors sorted by d (ties by name),

* ``local`` (DP_l) sends the slowest-moving tensors while their parameters stay within f of the group's
* ``global`` (DP_g) sends the fastest-moving tensors until they hold at least f of the group's parameters
  (the tensor that crosses the line goes to global, so at f = 0.5 local and global are exact complements)
* ``random`` takes, per group, tensors in a random order (``rng``) while they fit in the parameters ``global``
  would send (first fit: never more, and short by less than any tensor it leaves out)
* ``all`` sends everything.

``by="count"`` is the first version's rule, kept as an option: f is a share of the group's *tensors*, with
``torch.quantile`` thresholds (linear interpolation, float64): local sends d_t < quantile(d, f), global
d_t >= quantile(d, 1 − f), random as many tensors as global. By count, "50 %" of a GRU language model is
0.4 % (local) or 99.6 % (global) of its bytes, because the few large matrices move most
(docs/results/nmt-domains.md).
Edge cases (both rules): a group of one tensor is sent by global and never by local; tensors with no previous
value (new tensors) are always sent; with no previous state at all (first round) everything is sent. The
result is in the order of ``current``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from fedmq.checks import check_number
from fedmq.errors import BadParameter

if TYPE_CHECKING:  # torch is imported where it is used: the round protocol reads MODES and SHARES without it
    import torch

MODES = (
    "local",
    "global",
    "random",
    "all",
)  # the paper's DP_l, DP_g, random; aggregator.config maps strategies to them
SHARES = ("params", "count")  # what the fraction is a share of
# what draws the random mode's sample (none needed by the other modes)
Rng = random.Random | np.random.Generator | None


def tensor_changes(
    current: Mapping[str, torch.Tensor], previous: Mapping[str, torch.Tensor]
) -> dict[str, float]:
    """d_t for every tensor present in both states."""
    import torch

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
    rng: Rng = None,
    by: str = "params",
) -> list[str]:
    """Names of the tensors to send (see module docstring for the exact rule)."""
    if mode not in MODES:
        raise BadParameter(f"pulling mode must be one of {', '.join(MODES)}, got {mode!r}")
    if by not in SHARES:
        raise BadParameter(f"pulling share must be one of {', '.join(SHARES)}, got {by!r}")
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
    pick = _by_params if by == "params" else _by_count
    for names in by_group.values():
        chosen.update(pick(names, d, {n: current[n].numel() for n in names}, mode, f, rng))
    return [name for name in current if name in chosen]


def _by_count(
    names: list[str], d: dict[str, float], _sizes: dict[str, int], mode: str, f: float, rng: Rng
) -> list[str]:
    import torch

    values = torch.tensor([d[n] for n in names], dtype=torch.float64)
    if mode == "local":
        theta = float(torch.quantile(values, f))
        return [n for n in names if d[n] < theta]
    theta = float(torch.quantile(values, 1.0 - f))
    picked = [n for n in names if d[n] >= theta]
    return picked if mode == "global" else _sample(sorted(names), len(picked), rng)


def _by_params(
    names: list[str], d: dict[str, float], sizes: dict[str, int], mode: str, f: float, rng: Rng
) -> list[str]:
    budget = f * sum(sizes.values())
    if mode == "local":  # slowest first, while the parameters sent stay within the budget
        sent, total = [], 0
        for n in sorted(names, key=lambda n: (d[n], n)):
            if total + sizes[n] > budget:
                break
            sent.append(n)
            total += sizes[n]
        return sent
    fastest = _prefix(sorted(names, key=lambda n: (-d[n], n)), sizes, budget)
    if mode == "global":
        return fastest
    return _fill(_sample(sorted(names), len(names), rng), sizes, sum(sizes[n] for n in fastest))


def _prefix(order: list[str], sizes: dict[str, int], budget: float) -> list[str]:
    """The first tensors of ``order`` until they hold at least ``budget`` parameters
    (the crossing one included)."""
    sent, total = [], 0
    for n in order:
        if total >= budget:
            break
        sent.append(n)
        total += sizes[n]
    return sent


def _fill(order: list[str], sizes: dict[str, int], budget: float) -> list[str]:
    """Tensors taken in ``order`` when they still fit in ``budget`` (first fit): never over it, and short of
    it by less than any tensor left out. Stopping at the tensor that crosses the line instead would overshoot
    by up to the largest tensor -- in the cpu-scale NMT model an embedding, 42 % of its group's parameters."""
    sent, total = [], 0
    for n in order:
        if total + sizes[n] <= budget:
            sent.append(n)
            total += sizes[n]
    return sent


def _sample(names: list[str], k: int, rng: Rng) -> list[str]:
    if isinstance(rng, np.random.Generator):
        return [names[i] for i in rng.choice(len(names), size=k, replace=False)]
    if isinstance(rng, random.Random):
        return rng.sample(names, k)
    raise BadParameter(f"rng must be random.Random or numpy.random.Generator, got {type(rng).__name__}")
