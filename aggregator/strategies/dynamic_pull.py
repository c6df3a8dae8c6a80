"""Dynamic-pulled aggregation (Passban et al. 2022): per-tensor FedAvg over the clients that sent it.

Each client sends only the tensors its pulling rule selected (client_agent.pulling.select_tensors). For
tensor t: θ_t ← Σ_{k sent t} n_k θ_{k,t} / Σ_{k sent t} n_k; a tensor nobody sent keeps the server's value.
The same class serves dp-l, dp-g and dp-random (they differ only on the client side).
"""

from __future__ import annotations

from typing import ClassVar, Mapping

import torch

from aggregator.strategies._common import cast_like, check_started, validate_update, zeros_like_state
from aggregator.strategies.base import ClientUpdate, State, Strategy


class DynamicPull(Strategy):
    name: ClassVar[str] = "dynamic-pull"

    def __init__(self, rule: str = "dp-g") -> None:
        self.rule = rule  # informational: which client-side rule the round config asks for
        self._global: Mapping[str, torch.Tensor] | None = None
        self._acc: State = {}
        self._n: dict[str, int] = {}  # per tensor Σ n_k over the clients that sent it
        self._share: dict[str, dict[str, float]] = {}  # client -> tensor -> n_k (for client_weights)
        self._last_weights: dict[str, float] = {}
        self.last_samples_per_tensor: dict[str, int] = {}

    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        self._global = global_state
        self._acc = {}
        self._n = {}
        self._share = {}

    def fold(self, update: ClientUpdate) -> None:
        g = check_started(self._global, self.name)
        validate_update(update, g, subset=True)
        for name, t in update.tensors.items():
            acc = self._acc.get(name)
            if acc is None:  # allocated lazily: tensors nobody sends cost nothing
                acc = self._acc[name] = zeros_like_state({name: g[name]})[name]
            acc.add_(t, alpha=update.n_samples)
            self._n[name] = self._n.get(name, 0) + update.n_samples
        key = update.client
        while key in self._share:
            key += "'"
        self._share[key] = {name: float(update.n_samples) for name in update.tensors}

    def finish(self) -> State:
        g = check_started(self._global, self.name)
        out: State = {}
        for name, ref in g.items():
            if name in self._acc:
                out[name] = self._acc[name].div_(self._n[name])
            else:
                out[name] = ref.clone()
        out = cast_like(out, g)
        # mean over all tensors of the client's share of each tensor (0 for tensors it did not send)
        self._last_weights = {
            c: sum(n / self._n[name] for name, n in sent.items()) / len(g) for c, sent in self._share.items()
        } if g else {}
        self.last_samples_per_tensor = dict(self._n)
        self._global, self._acc = None, {}
        return out

