"""A strategy's client side: what every selected agent does around its local training (Flower's client mods).

A strategy names its hook (``Strategy.client_hook``); each round's announcement carries the hook's name, its
version and its arguments (``Strategy.client_args``), and every selected agent builds the hook and calls,
in order:

- ``begin(global_state, train, kept)``: before training; ``global_state`` is the model the client trains from,
  ``train`` the local training settings (lr, steps …), ``kept`` the client's own state from earlier rounds;
- ``gradient(name, param)``, at every local step, for every parameter: a term added to the parameter's
  gradient before the optimizer step, i.e. the gradient of a term added to the training loss (FedProx's
  proximal term μ/2·‖w − w_t‖² has gradient μ(w − w_t)); None adds nothing.
  It works with any task's training loop;
- ``finish(trained, result, kept)``: after training; returns the state to upload (default: ``trained``) and
  keeps what the client needs next time (``kept.put``).

``kept`` lives in the agent's state store (memory for a service, files under the run folder for
`fedmq simulate`), one namespace per hook. The agent only imports hooks from fedmq itself or from the module
of the strategy it was started with (``--config``'s strategy),
so an announcement can never make an agent import arbitrary code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import torch

from fedmq.tasks.base import TrainConfig, TrainResult

State = dict[str, torch.Tensor]
# the announcement's client map: {"version": PROTOCOL, "hook": "package.module:Class", "args": {...}}
PROTOCOL = 1


class Store(Protocol):
    def put(self, client: str, name: str, version: int, state: State) -> None: ...
    def get(self, client: str, name: str) -> tuple[int, State] | None: ...
    def drop(self, client: str, name: str) -> None: ...


class Kept:
    """One client's state across the rounds it takes part in, for one hook: named dicts of tensors."""

    def __init__(self, store: Store, client: str, namespace: str, version: int) -> None:
        self._store, self._client, self._ns, self._version = store, client, namespace, version

    def get(self, key: str) -> State | None:
        item = self._store.get(self._client, f"{self._ns}.{key}")
        return None if item is None else item[1]

    def put(self, key: str, state: Mapping[str, torch.Tensor]) -> None:
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

    @classmethod
    def extra_tensors(cls, names: Sequence[str]) -> dict[str, str]:
        """Tensors the strategy keeps beside the model, each shaped like a model tensor: {its name: the model
        tensor's name}. They start at zero, travel in the global model to every selected client (``begin``
        finds them in ``global_state``), come back in the client's upload (``finish`` returns them: the
        strategy folds their change), and are checkpointed with the model. SCAFFOLD's control variate c is one
        per parameter. Default: none."""
        return {}

    def begin(self, global_state: Mapping[str, torch.Tensor], train: TrainConfig, kept: Kept) -> None:
        """Before local training."""

    def gradient(self, name: str, param: torch.Tensor) -> torch.Tensor | None:
        """A term added to ``param``'s gradient at every local step (``param``: its value at that step)."""
        return None

    def finish(self, trained: State, result: TrainResult, kept: Kept) -> State:
        """After local training: the state to upload."""
        return trained


def hook_path(cls: type[ClientHook]) -> str:
    """The import path a hook class travels under in the announcement."""
    return f"{cls.__module__}:{cls.__qualname__}"


def install_gradient_terms(model: torch.nn.Module, hook: ClientHook) -> Callable[[], None]:
    """Register ``hook.gradient`` on every parameter of ``model`` (once per tensor, also when tied); returns
    the function that removes them. Nothing is registered when the hook does not override ``gradient``."""
    if type(hook).gradient is ClientHook.gradient:
        return lambda: None
    handles = []
    for name, param in model.named_parameters():
        if param.requires_grad:

            def term(grad: torch.Tensor, name: str = name, param: torch.Tensor = param) -> torch.Tensor:
                extra = hook.gradient(name, param.detach())
                return grad if extra is None else grad + extra.to(grad.dtype)

            handles.append(param.register_hook(term))

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


def describe(cls: type[ClientHook] | None, args: Mapping[str, Any]) -> dict[str, Any]:
    """The announcement's client map for a strategy's hook (empty when it has none)."""
    if cls is None:
        return {}
    return {"version": PROTOCOL, "hook": hook_path(cls), "hook_version": cls.version, "args": dict(args)}
