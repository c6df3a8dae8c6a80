"""The interface every aggregation strategy implements: what it asks of a round (``plan``,
``configure_train``, ``from_config``; Flower's configure_train),
then fold updates one at a time and finish (its aggregate_train)."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedmq.errors import BadParameter
from fedmq.hooks import ClientHook
from fedmq.state_checks import state_problem
from fedmq.tasks.base import State
from fedmq.train_config import TrainConfig


@dataclass
class ClientUpdate:
    """One client's contribution, already decoded and validated against the manifest.

    ``tensors`` are the client's weights θ_k, or with ``delta`` set its change Δ_k = θ_k − θ_base from the
    model it trained from (for a synchronous round, the global model given to ``begin``). The engine hands
    updates over as deltas: the wire carries them, and folding Δ_k skips both adding the base back and
    the second read a distance ‖θ − θ_k‖ needs. Strategies accept either form, and mixing them in a round.
    Under dynamic pulling a client sends only some tensors: ``tensors`` is then a subset of the manifest.
    """

    client: str
    n_samples: int
    tensors: Mapping[str, torch.Tensor]
    loss: float | None = None
    staleness: int = 0  # asynchronous mode: global versions published since the client's base
    update_id: str = ""
    delta: bool = False


@dataclass
class PartialSum:
    """What an edge aggregator folded of a round (``Strategy.partial``), for the root to add into its own
    running sums (``Strategy.fold_partial``): per tensor the accumulator Σ_k w_k x_k and its weights
    (Σ_k w_k, and the part of it folded as deltas), the denominator's count, and each client's weight."""

    sums: dict[str, torch.Tensor]
    weights: dict[str, tuple[float, float]]  # tensor -> (Σ w_k, Σ w_k of the delta terms)
    count: float
    terms: dict[str, float]  # client -> w_k (client_weights)


@dataclass(frozen=True)
class RoundPlan:
    """The shape of a strategy's rounds, read by the engine and (through the round config) the agents, so that
    nothing else branches on a strategy's name. The defaults are FedAvg's."""

    mode: str = "sync"  # sync rounds, or "async": fold every K arrivals whatever their round (BufferedAsync)
    select_all: bool = False  # every client trains each round, whatever the fraction C (FedSGD)
    # collect every report before granting uploads, even at β = 1 (FedMed's mediator)
    grant_phase: bool = False
    # each round the mediator's loss switch picks this strategy or plain FedAvg (FedMed)
    loss_switch: bool = False
    pull: str = "all"  # which tensors agents upload: all, or a dynamic-pulling rule (fedmq.pulling.MODES)


class Strategy(ABC):
    """A federated algorithm's server side: what it asks of a round, and its aggregation.

    The round: ``plan`` (who is selected, grant phase, pulling rule, sync or async), ``configure_train`` (the
    local training the agents run), ``client_hook`` (the algorithm's client side, if it has one) and
    ``from_config`` (the strategy built from the job's settings each round).
    The aggregation streams: ``begin`` with θ_r, ``fold`` each update as it arrives, ``finish`` -> θ_{r+1}.
    Memory is a small fixed number of model-sized buffers, whatever the number of folded updates.
    ``finish`` with no folded update returns θ_r unchanged.

    Parameters are the constructor's keyword arguments, given the same way from Python
    (``JobConfig(strategy_args={...})``), the job file (a ``[strategy]`` table) and the command line
    (``--strategy-arg KEY=VALUE``); ``from_config`` checks them against the constructor's signature and type
    hints. A strategy is built afresh for every round; what must outlive a round (a server optimizer's
    moments, control variates) it returns from ``state_dict`` after ``finish``, and the engine hands it to the
    next round's strategy with ``load_state_dict`` before ``begin`` -- keeping it in every round's checkpoint,
    so a restarted aggregator resumes it exactly.
    """

    name: ClassVar[str]
    plan: ClassVar[RoundPlan] = RoundPlan()
    # the algorithm's client side, run by every selected agent around its local training
    # (fedmq.hooks.ClientHook)
    client_hook: ClassVar[type[ClientHook] | None] = None
    # keys of ``state_dict`` holding one tensor per model tensor, keyed by its name (a server optimizer's
    # moments): check_state asks each to be such a dict
    per_tensor_state: ClassVar[tuple[str, ...]] = ()
    # its aggregate is made of running sums that folding another's ``partial`` into (``fold_partial``) gives
    # exactly as folding its updates would, up to float rounding: two-tier aggregation (edge aggregators,
    # docs/guide/edges.md) runs only such strategies. FedAvg's subclasses have them unless they override
    # ``fold`` or ``second_pass`` (then they say so themselves)
    partial_sums: ClassVar[bool] = False
    # its aggregate is a weighted mean of the clients' changes whose weight a client can compute itself (n_k,
    # or 1): secure aggregation (docs/guide/secure-aggregation.md), where the aggregator learns only the sum,
    # runs only such strategies. FedAvg's subclasses have it unless they override ``fold``, ``second_pass``,
    # ``weight`` or ``count`` (then they say so themselves)
    secure_sum: ClassVar[bool] = False

    @property
    def weighs_samples(self) -> bool:
        """Under secure aggregation, whether a client weighs its change by n_k (else by 1)."""
        return True

    @classmethod
    def from_config(cls, cfg: Any, **extra: Any) -> Strategy:
        """This round's strategy from the job's settings (``cfg``: an aggregator.config.JobConfig): the
        constructor called with the job's ``strategy_args``, checked (one line naming the key when one is
        unknown or of the wrong type); ``extra``: what ``second_pass`` asked for."""
        return cls.from_settings(cfg, {}, **extra)

    @classmethod
    def from_settings(cls, cfg: Any, settings: Mapping[str, tuple[str, Any]], **extra: Any) -> Strategy:
        """The constructor called with ``settings`` -- {parameter: (the job's field it comes from, its
        value)}, what a robust guard reads from the job's own fields, such as its ``clip_norm`` from
        ``robust`` -- and the job's ``strategy_args`` for its other parameters. A parameter has one way in:
        strategy_args naming one of ``settings`` is refused with the field (and flag) to use instead."""
        from fedmq.params import bind

        args = bind(cls, cfg.strategy_args)
        twice = sorted(set(args) & set(settings))
        if twice:
            field = settings[twice[0]][0]
            raise BadParameter(
                f"strategy {cls.name!r}: {twice[0]} is the job setting {field}; set it there, not as a "
                "strategy argument"
            )
        return cls(**{p: value for p, (_, value) in settings.items()}, **args, **extra)

    @classmethod
    def client_args(cls, args: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments the client hook is built with in every agent, from the strategy's own (checked)
        arguments: by default those the hook's constructor names. They travel in the round announcement."""
        if cls.client_hook is None:
            return {}
        names = set(inspect.signature(cls.client_hook).parameters)
        return {k: v for k, v in args.items() if k in names}

    def state_dict(self) -> dict[str, Any]:
        """What this strategy carries into the next round, read after ``finish``: tensors, numbers, strings,
        and lists or dicts of them. Default: nothing."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The previous round's ``state_dict`` (empty in the first round), given before ``begin``."""
        return None

    def check_state(self, state: Mapping[str, Any], model: Mapping[str, torch.Tensor]) -> str | None:
        """Why ``state`` (a ``state_dict``) may not be kept, in one line, or None. The engine asks after
        ``finish`` (a round whose state fails is skipped) and at restore (a checkpoint whose state fails is
        refused). Default (fedmq.state_checks): each ``per_tensor_state`` entry a dict of tensors keyed by
        model tensor names; every tensor finite, of a bounded norm, and shaped like the model tensor whose
        name keys it. Override to add the algorithm's own bounds."""
        for key in self.per_tensor_state:
            held = state.get(key, {})
            if not isinstance(held, Mapping):
                return f"{key}: a {type(held).__name__}, not a dict of tensors"
            odd = next((n for n, t in held.items() if n not in model or not torch.is_tensor(t)), None)
            if odd is not None:
                return f"{key}[{odd!r}]: not a tensor of the model"
        return state_problem(state, {name: tuple(t.shape) for name, t in model.items()})

    @classmethod
    def configure_train(cls, train: TrainConfig) -> TrainConfig:
        """The local training the selected agents run (Flower's configure_train), from the one the job's
        settings give; default unchanged."""
        return train

    @abstractmethod
    def begin(self, global_state: Mapping[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def fold(self, update: ClientUpdate) -> None: ...

    @abstractmethod
    def finish(self) -> State: ...

    _last_weights: dict[str, float] = {}  # finish() sets the instance's own

    def partial(self) -> PartialSum:
        """An edge's side of two-tier aggregation: what was folded since ``begin``, as sums (the strategy is
        used up). Only where ``partial_sums`` is set."""
        raise NotImplementedError(f"strategy {self.name!r} has no partial sums")

    def fold_partial(self, part: PartialSum) -> None:
        """The root's side: add an edge's ``partial`` into this round's sums, as if its updates were folded
        here; or a secure round's unmasked sum (aggregator.secure_round). Raise (changing nothing) if it does
        not fit the model. Only where ``partial_sums`` or ``secure_sum`` is set."""
        raise NotImplementedError(f"strategy {self.name!r} has no partial sums")

    def second_pass(self, exclude: frozenset[str] = frozenset()) -> dict | None:
        """Parameters for folding the same updates again (leaving out ``exclude``), when the weights depend on
        the whole round and so cannot be known while streaming (FedMed's standardised JS); None:
        one pass is all."""
        return None

    def client_weights(self) -> dict[str, float]:
        """Per-client weight summary of the last aggregation (mean over tensors), for metrics and plots."""
        return dict(self._last_weights)


def aggregate(
    make: Callable[..., Strategy], global_state: Mapping[str, torch.Tensor], updates: Iterable[ClientUpdate]
) -> tuple[State, Strategy]:
    """One whole round in memory: ``make()`` a strategy, fold ``updates``, fold them again into
    ``make(**extra)`` when the strategy asks for a second pass, finish. The engine does the same from its
    spool; this is for tools and tests that hold the updates. Returns the new model and the strategy that made
    it (for client_weights)."""
    updates = list(updates)
    strategy = make()
    strategy.begin(global_state)
    for u in updates:
        strategy.fold(u)
    extra = strategy.second_pass()
    if extra is not None:
        strategy = make(**extra)
        strategy.begin(global_state)
        for u in updates:
            strategy.fold(u)
    return strategy.finish(), strategy
