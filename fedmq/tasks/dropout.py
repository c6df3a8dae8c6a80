"""Dropout drawing its masks from a per-model ``torch.Generator``.

Agents of one process train in parallel threads; torch's global RNG would interleave their draws and break
per-seed determinism. The training loop seeds ``model.dropout_generator`` (see ``set_dropout_generator``).
"""

from __future__ import annotations

import torch
from torch import nn


class SeededDropout(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {p}")
        self.p = p
        self.generator: torch.Generator | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.empty(x.shape, device=x.device, dtype=x.dtype).bernoulli_(
            1.0 - self.p, generator=self.generator
        )
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def set_dropout_generator(model: nn.Module, generator: torch.Generator | None) -> None:
    for m in model.modules():
        if isinstance(m, SeededDropout):
            m.generator = generator


def uniform_(t: torch.Tensor, bound: float, generator: torch.Generator) -> None:
    with torch.no_grad():
        t.uniform_(-bound, bound, generator=generator)
