"""A strategy's client side: what every selected agent does around its local training (Flower's client mods).

A round's announcement lists client hooks, each with its name, version and arguments: the strategy's own
(``Strategy.client_hook`` with ``Strategy.client_args``), then fedmq's upload hooks the job asks for
(fedmq.upload_hooks: FedAtt's randomization, dynamic pulling, error feedback). Every selected agent builds
them, gives each the round's ``context`` (ClientContext) and calls, hook by hook in that order:

- ``own_state(kept)``: the client's own values for the tensors a partial push (pull-down) leaves out; the
  first hook that has them answers (default: none: the agent's kept copy of the global model);
- ``start(global_state, kept)``: the state local training starts from (default: ``global_state``), each
  hook given the previous one's;
- ``begin(global_state, train, kept)``: before training; ``global_state`` is the model the client trains from,
  ``train`` the local training settings (lr, steps …), ``kept`` the client's own state from earlier rounds;
- ``gradient(name, param)``, at every local step, for every parameter: a term added to the parameter's
  gradient before the optimizer step, i.e. the gradient of a term added to the training loss (FedProx's
  proximal term μ/2·‖w − w_t‖² has gradient μ(w − w_t)); None adds nothing.
  It works with any task's training loop;
- ``finish(trained, result, kept)``: after training; returns the state to upload (default: ``trained``), each
  hook given the previous one's, and keeps what the client needs next time (``kept.put``). Returning a
  subset of the tensors uploads only those;
- ``sent(update, kept)``: after encoding, only for a hook that overrides it: ``update`` is what the
  aggregator will decode (for a delta encoding, the change from the global model).

``kept`` lives in the agent's state store (memory for a service, files under the run folder for
`fedmq simulate`), one namespace per hook. What a hook keeps must pass fedmq.state_checks (finite, of a
bounded norm): ``put`` refuses it with a CodecError, and the agent sits the round out without storing it or
uploading. The agent only imports hooks from fedmq itself or from the module
of the strategy it was started with (``--config``'s strategy),
so an announcement can never make an agent import arbitrary code.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from fedmq import client_map
from fedmq.errors import CodecError
from fedmq.state_checks import state_problem
from fedmq.tasks.base import State, TrainConfig, TrainResult

# the newest announcement client map this build reads (fedmq.client_map)
PROTOCOL = client_map.VERSION


def stable_seed(*parts: object) -> int:
    """A seed derived from values, identical in every process (unlike hash() of strings)."""
    return zlib.crc32("/".join(map(str, parts)).encode())


@dataclass
class ClientContext:
    """What a hook knows of the round it runs in (set by the agent as ``hook.context``)."""

    client: str
    round: int
    version: int  # the global model's version the client trains from
    seed: int  # the job's seed: ``stable_seed(seed, client, round, …)`` draws the same numbers in every run
    groups: Mapping[str, str] = field(default_factory=dict)  # tensor name -> its group (fedmq.pulling)
    held: State = field(default_factory=dict)  # the global model as fetched (the base of delta uploads)
    trained: State = field(default_factory=dict)  # the model after local training, before any ``finish``
    # the seed a privacy hook draws its noise from: the job's seed in `fedmq simulate` only; None (every
    # service): from the OS CSPRNG (fedmq.privacy.mechanism.noise_generator)
    noise_seed: int | None = None


class Store(Protocol):
    def put(self, client: str, name: str, version: int, state: State) -> None: ...
    def get(self, client: str, name: str) -> tuple[int, State] | None: ...
    def drop(self, client: str, name: str) -> None: ...


class Kept:
    """One client's state across the rounds it takes part in, for one hook: named dicts of tensors."""

    def __init__(self, store: Store, client: str, namespace: str, version: int) -> None:
        self._store, self._client, self._ns, self._version = store, client, namespace, version

    @property
    def version(self) -> int:
        """The global model's version this round trains from: what ``put`` records with the state."""
        return self._version

    def get(self, key: str, legacy: str | None = None) -> State | None:
        """The state kept under ``key``; ``legacy``: the store key it had before hooks had namespaces (a run
        folder made then resumes with it)."""
        item = self.entry(key, legacy)
        return None if item is None else item[1]

    def entry(self, key: str, legacy: str | None = None) -> tuple[int, State] | None:
        """The state kept under ``key`` with the version of the round that put it (``get``'s arguments)."""
        item = self._store.get(self._client, f"{self._ns}.{key}")
        if item is None and legacy is not None:
            item = self._store.get(self._client, legacy)
        return item

    def put(self, key: str, state: Mapping[str, torch.Tensor]) -> None:
        """Keep ``state`` under ``key``; CodecError (nothing kept) when it fails fedmq.state_checks."""
        why = state_problem(dict(state))
        if why is not None:
            raise CodecError("bad-state", f"{self._ns}.{key} not kept: {why}")
        self._store.put(
            self._client,
            f"{self._ns}.{key}",
            self._version,
            {k: v.detach().clone() for k, v in state.items()},
        )


class ClientHook:
    """The client side of a strategy; subclass it and override what the algorithm needs (module docstring).
    Its constructor's keyword arguments are its parameters (they come from the strategy's)."""

    name: ClassVar[str] = ""
    version: ClassVar[int] = 1
    context: ClientContext  # the round's, set by the agent before any call

    @classmethod
    def extra_tensors(cls, names: Sequence[str]) -> dict[str, str]:
        """Tensors the strategy keeps beside the model, each shaped like a model tensor: {its name: the model
        tensor's name}. They start at zero, travel in the global model to every selected client (``begin``
        finds them in ``global_state``), come back in the client's upload (``finish`` returns them: the
        strategy folds their change), and are checkpointed with the model. SCAFFOLD's control variate c is one
        per parameter. Default: none."""
        return {}

    def own_state(self, kept: Kept) -> State | None:
        """The client's own values for the tensors a partial push leaves out (None: not this hook's)."""
        return None

    def start(self, global_state: State, kept: Kept) -> State:
        """The state local training starts from. ``global_state`` is shared by the clients of this process
        that train from the same model: build new tensors for what the hook changes, never change its own in
        place."""
        return global_state

    def begin(self, global_state: Mapping[str, torch.Tensor], train: TrainConfig, kept: Kept) -> None:
        """Before local training (``global_state``: shared, read only, as in ``start``)."""

    def gradient(self, name: str, param: torch.Tensor) -> torch.Tensor | None:
        """A term added to ``param``'s gradient at every local step (``param``: its value at that step)."""
        return None

    def finish(self, trained: State, result: TrainResult, kept: Kept) -> State:
        """After local training: the state to upload."""
        return trained

    def sent(self, update: Mapping[str, torch.Tensor], kept: Kept) -> None:
        """After encoding: ``update`` as the aggregator will decode it."""

    @classmethod
    def changes_training(cls) -> bool:
        """Whether the hook acts inside local training (``gradient``): a batched cohort cannot run it."""
        return cls.gradient is not ClientHook.gradient

    @classmethod
    def reads_what_is_sent(cls) -> bool:
        """Whether the agent must decode its own upload for ``sent``."""
        return cls.sent is not ClientHook.sent


def hook_path(cls: type[ClientHook]) -> str:
    """The import path a hook class travels under in the announcement."""
    return f"{cls.__module__}:{cls.__qualname__}"


class GradientTerms:
    """A hook's gradient terms on one model's parameters. Registered as tensor hooks, they run at every
    backward pass, which is one local step in a training loop of one's own. fedmq's loop
    (fedmq.tasks.training) sums several backward passes into one step (the full-batch step of FedSGD) and
    scales the gradient under mixed precision, so it sets ``deferred`` and calls :meth:`add` once, on the
    step's finished, unscaled gradient: the term is added once per step either way."""

    ATTRIBUTE = "_fedmq_gradient_terms"  # where a model holds its terms while they are installed

    def __init__(self, model: torch.nn.Module, hook: ClientHook) -> None:
        self.hook = hook
        self.deferred = False
        self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def term(self, name: str, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The tensor hook's work: ``grad`` plus the hook's term (``grad`` itself while deferred)."""
        if self.deferred:
            return grad
        extra = self.hook.gradient(name, param.detach())
        return grad if extra is None else grad + extra.to(grad.dtype)

    def add(self) -> None:
        """Add the terms once to the parameters' gradients as they stand."""
        for name, param in self._params:
            if param.grad is not None:
                extra = self.hook.gradient(name, param.detach())
                if extra is not None:
                    param.grad.add_(extra.to(param.grad.dtype))


def install_gradient_terms(model: torch.nn.Module, hook: ClientHook) -> Callable[[], None]:
    """Register ``hook.gradient`` on every parameter of ``model`` (once per tensor, also when tied); returns
    the function that removes them. Nothing is registered when the hook does not override ``gradient``."""
    if not type(hook).changes_training():
        return lambda: None
    terms = GradientTerms(model, hook)
    handles = [
        param.register_hook(lambda grad, name=name, param=param: terms.term(name, param, grad))
        for name, param in terms._params
    ]
    setattr(model, GradientTerms.ATTRIBUTE, terms)

    def remove() -> None:
        for handle in handles:
            handle.remove()
        if getattr(model, GradientTerms.ATTRIBUTE, None) is terms:
            delattr(model, GradientTerms.ATTRIBUTE)

    return remove


def describe(hooks: Sequence[tuple[type[ClientHook], Mapping[str, Any]]]) -> dict[str, Any]:
    """The announcement's client map for these hooks and their arguments, in the order they run (empty for
    none)."""
    if not hooks:
        return {}
    return {
        "version": client_map.PLAIN,
        "hooks": [
            {"hook": hook_path(cls), "hook_version": cls.version, "args": dict(args)} for cls, args in hooks
        ],
    }
