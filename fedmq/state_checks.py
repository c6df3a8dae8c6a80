"""The check every piece of state that outlives a round passes before it is kept: the global model, a
strategy's ``state_dict`` (a server optimizer's moments), a checkpoint's strategy state at restore, and what
an agent keeps for a client hook (SCAFFOLD's c_i) or receives beside the model (the server's c).

One accepted round can otherwise freeze a job for good without a NaN in the model: FedAdam's v = inf makes
every later step m / √v zero, and a control variate of 1e30 makes every client's gradient norm overflow, so
clipping zeroes every local step. The rule (:func:`state_problem`): every tensor is a floating tensor, finite,
with an L2 norm whose square is a float32 number (‖t‖ ≤ ~1.8e19: the gradient clipping and the guard's norm
read it in float32), and a tensor keyed by a model tensor's name has that tensor's shape. The answer is one
line naming the tensor, or None.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

NORM_MAX = math.sqrt(float(np.finfo(np.float32).max))  # ‖t‖² must be a float32 number


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite. One read-only pass, its norm: a NaN or an infinity makes
    the norm non-finite, so a finite norm settles it; only a non-finite one (or an overflow) is looked at
    element by element. torch's ``isfinite(t).all()`` alone takes about 35 times as long on a model-sized
    float32 tensor (0.12 s for 10 M elements on the 2-core x86 VM of docs/benchmarks.md)."""
    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return True  # integers and booleans are always finite
    t = t.detach()
    return math.isfinite(float(torch.linalg.vector_norm(t))) or bool(torch.isfinite(t).all())


def tensor_problem(t: torch.Tensor, shape: Sequence[int] | None = None) -> str | None:
    """Why the tensor ``t`` may not be kept (see the module docstring), or None."""
    if not t.is_floating_point():
        return f"dtype {str(t.dtype).replace('torch.', '')} is not floating point"
    if shape is not None and tuple(t.shape) != tuple(shape):
        return f"shape {list(t.shape)} is not the model's {list(shape)}"
    t = t.detach()
    # the norm in the tensor's own precision first (no copy of a float32 model): one below the bound is also
    # finite, so every element is (all_finite); only a norm near the bound, or one that is not finite, is
    # looked at again: element by element, and in float64 to judge it exactly
    if float(torch.linalg.vector_norm(t)) < NORM_MAX * 0.99:
        return None
    if not all_finite(t):
        return "not finite"
    norm = float(torch.linalg.vector_norm(t.double()))
    if not norm <= NORM_MAX:
        return f"norm {norm:.3g} > {NORM_MAX:.3g}"
    return None


def state_problem(
    state: Any, shapes: Mapping[str, Sequence[int]] | None = None, where: str = "", key: str = ""
) -> str | None:
    """The first tensor of ``state`` (tensors nested in dicts and lists) that may not be kept, with why, or
    None. ``shapes``: the model's tensor shapes by name; a tensor keyed by one of those names has its shape.
    Numbers must be finite; other values (strings, None, bools) pass."""
    if isinstance(state, torch.Tensor):
        why = tensor_problem(state, (shapes or {}).get(key))
        return None if why is None else f"{where or 'tensor'}: {why}"
    if isinstance(state, Mapping):
        for name, value in state.items():
            why = state_problem(value, shapes, f"{where}[{name!r}]" if where else str(name), str(name))
            if why is not None:
                return why
        return None
    if isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            why = state_problem(value, shapes, f"{where}[{i}]")
            if why is not None:
                return why
        return None
    if isinstance(state, float) and not math.isfinite(state):
        return f"{where or 'value'}: {state} is not finite"
    return None
