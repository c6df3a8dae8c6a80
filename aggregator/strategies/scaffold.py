"""SCAFFOLD (Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning",
Algorithm 1 with option II): control variates correct each client's drift.

The server keeps a control variate c beside the model x; each client i keeps its own c_i (zero at first).
In a round every selected client starts from y_i = x and takes K local steps

    y_i ← y_i − η_l · (g_i(y_i) − c_i + c)

then sets c_i⁺ = c_i − c + (x − y_i) / (K·η_l) (option II) and uploads Δy_i = y_i − x and Δc_i = c_i⁺ − c_i.
The server, with S the round's clients and N the population:

    x ← x + η_g · (1/|S|) Σ Δy_i,        c ← c + (1/N) Σ Δc_i      (= (|S|/N) · mean Δc_i)

Both sums are unweighted, as in the paper, so under secure aggregation one secure sum of the clients'
(Δy_i, Δc_i) gives both (``fold_partial``): each client masks its change of the model and of c together
(c is one of the tensors it uploads), weighing itself by 1. c travels with the model as one extra tensor per
parameter (``scaffold.c:NAME``, ClientHook.extra_tensors): published to the clients each round, checkpointed
with x. K is the number of steps the client took (TrainResult.steps) and η_l the round's learning rate;
option II assumes plain SGD steps (no momentum, no lr decay within the round, no clipping).

Resuming bit for bit: a client keeps c_i⁺ together with the c_i it trained from, keyed by the global model's
version that round trained from (one kept entry, written at once). A round that trains from a newer version
starts from c_i⁺; one that trains from the same version again starts from the old c_i. So a client that
trains a round again (a restarted `fedmq simulate` re-announces the open round; the aggregator already holds
its spooled update, or not yet) computes the same c_i⁺ and the same upload, and the aggregator drops the copy
as a duplicate; a round skipped without folding anything leaves c_i as it was. An update that is not folded
while the round closes with others' (not granted, refused by the guard, too late) still advances c_i, as a
selected client does in the paper. The cost: a client keeps two control variates instead of one.

Parameter (``--strategy-arg server_lr=1.0``): ``server_lr`` η_g (default 1).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from fedmq.aggregator.strategies._common import MAX_SERVER_LR, check_started, check_sums, validate_update
from fedmq.aggregator.strategies.base import ClientUpdate, PartialSum, State, Strategy
from fedmq.errors import BadParameter, StrategyError
from fedmq.hooks import ClientHook, Kept
from fedmq.tasks.base import TrainConfig, TrainResult

log = logging.getLogger(__name__)

PREFIX = "scaffold.c:"
BEFORE = "before:"  # in a client's kept entry: the c_i that round trained from, beside c_i⁺


class ScaffoldHook(ClientHook):
    """The client side: the drift correction c − c_i on every local step, and option II's new c_i."""

    name: ClassVar[str] = "scaffold"

    @classmethod
    def extra_tensors(cls, names: Sequence[str]) -> dict[str, str]:
        return {PREFIX + n: n for n in names}

    def begin(self, global_state: Mapping[str, torch.Tensor], train: TrainConfig, kept: Kept) -> None:
        self.x = {k: v.detach().clone() for k, v in global_state.items() if not k.startswith(PREFIX)}
        self.c = {k: global_state[PREFIX + k].detach().clone() for k in self.x}
        self.c_i = self._control_variate(kept)
        self.correction = {k: self.c[k] - self.c_i[k] for k in self.x}
        self.lr = train.lr

    def _control_variate(self, kept: Kept) -> State:
        """c_i for this round: c_i⁺ of the client's last round, or, when that round trained from this same
        version (a retrain), the c_i it started from (module docstring); zero at first."""
        entry = kept.entry("c")
        if entry is None:
            return {k: torch.zeros_like(v) for k, v in self.c.items()}
        version, saved = entry
        retrain = version == kept.version and all(BEFORE + k in saved for k in self.x)
        return {k: saved[BEFORE + k if retrain else k] for k in self.x}

    def gradient(self, name: str, param: torch.Tensor) -> torch.Tensor | None:
        term = self.correction[name]
        if term.device != param.device:
            term = self.correction[name] = term.to(param.device)
        return term

    def finish(self, trained: State, result: TrainResult, kept: Kept) -> State:
        steps = max(result.steps, 1)
        c_new = {
            k: self.c_i[k] - self.c[k] + (self.x[k] - trained[k].detach()) / (steps * self.lr) for k in self.x
        }
        kept.put("c", {**c_new, **{BEFORE + k: v for k, v in self.c_i.items()}})
        # the upload: y_i, and c + Δc_i, so that its difference from the global state is Δc_i
        return {**trained, **{PREFIX + k: self.c[k] + (c_new[k] - self.c_i[k]) for k in self.x}}


_said: set[str] = set()  # the unmet assumptions this process has warned of (one line each)


def unmet_assumption(cfg: Any) -> str:
    """What of the local training breaks option II's plain SGD steps, or "": c_i⁺ = c_i − c +
    (x − y_i)/(K·η_l) is the mean gradient only when every step was y ← y − η_l·g (clipping shortens the
    steps, momentum and a decaying lr change them)."""
    unmet = [
        f"{name} {value}"
        for name, value, plain in (
            ("clip", cfg.clip, cfg.clip == 0),
            ("momentum", cfg.momentum, cfg.momentum == 0),
            ("lr_decay", cfg.lr_decay, cfg.lr_decay == 1),
            ("optimizer", cfg.optimizer, cfg.optimizer == "sgd"),
        )
        if not plain
    ]
    return ", ".join(unmet)


def _say_unmet_assumption(cfg: Any) -> None:
    unmet = unmet_assumption(cfg)
    if unmet and unmet not in _said:
        _said.add(unmet)
        log.warning(
            "scaffold: option II assumes plain SGD steps, and the local training has %s: the control "
            "variates then estimate the clients' mean gradient only roughly (set clip = 0, momentum = 0, "
            "lr_decay = 1 and optimizer = sgd to meet it; without clipping, lower the lr)",
            unmet,
        )


class Scaffold(Strategy):
    name: ClassVar[str] = "scaffold"
    client_hook: ClassVar[type[ClientHook] | None] = ScaffoldHook
    secure_sum: ClassVar[bool] = True  # Σ Δy_i and Σ Δc_i, unweighted (module docstring)

    def __init__(self, server_lr: float = 1.0) -> None:
        if not 0 < server_lr <= MAX_SERVER_LR:
            raise BadParameter(
                f"strategy 'scaffold': server_lr must be in (0, {MAX_SERVER_LR}], got {server_lr}"
            )
        self.server_lr = server_lr
        self.population = 0  # N, the job's clients (from_config)
        self._global: Mapping[str, torch.Tensor] | None = None

    @classmethod
    def from_config(cls, cfg: Any, **extra: Any) -> Strategy:
        strategy = super().from_config(cfg, **extra)
        strategy.population = cfg.clients  # type: ignore[attr-defined]
        _say_unmet_assumption(cfg)
        return strategy

    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None:
        self._global = global_state
        self._sums = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in global_state.items()}
        self._clients: list[str] = []

    def fold(self, update: ClientUpdate) -> None:
        g = check_started(self._global, self.name)
        validate_update(update, g)
        for k, t in update.tensors.items():
            self._sums[k] += (t if update.delta else t - g[k]).double()
        self._clients.append(update.client)

    @property
    def weighs_samples(self) -> bool:
        return False  # every client weighs 1

    def fold_partial(self, part: PartialSum) -> None:
        """A secure round's sum of the survivors' (Δy_i, Δc_i), each weighed 1."""
        g = check_started(self._global, self.name)
        check_sums(part.sums, g, "secure sum")
        twice = sorted(set(part.terms) & set(self._clients))
        if twice:
            raise StrategyError(f"secure sum: client {twice[0]!r} folded twice")
        for k, t in part.sums.items():
            self._sums[k] += t.double()
        self._clients.extend(part.terms)

    def finish(self) -> State:
        g = check_started(self._global, self.name)
        m = len(self._clients)
        self._last_weights = {c: 1 / m for c in self._clients} if m else {}
        if not m:
            return {k: v.clone() for k, v in g.items()}
        population = max(self.population, m)
        out = {}
        for k, v in g.items():
            step = self._sums[k] / population if k.startswith(PREFIX) else self.server_lr * self._sums[k] / m
            out[k] = (v.double() + step).to(v.dtype)
        return out
