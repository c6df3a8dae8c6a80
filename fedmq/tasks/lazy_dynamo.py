"""Training with a torch optimizer without importing torch._dynamo.

A torch optimizer imports torch._dynamo -- and sympy with it -- the first time it is built: about 1.8 s of
CPU, as long again as ``import torch``, paid by every process that trains. It needs it only to keep
TorchDynamo out of some of its functions: ``Optimizer.add_param_group``, ``zero_grad``, ``state_dict``,
``load_state_dict`` and the functional ``adam`` are marked "do not compile" (``torch._disable_dynamo``, which
imports torch._dynamo to make the mark on their first call), and every ``step`` switches grad mode between
two ``torch._dynamo.graph_break()`` calls. Both matter only while TorchDynamo compiles, and it compiles only
once torch._dynamo is imported (``torch.compile`` imports it). ``defer()`` gives those functions versions
that do exactly what they did, minus TorchDynamo, until torch._dynamo is imported, and torch's own from
then on: a process that never compiles never imports it; one that does behaves as before.

fedmq's command-line services call ``defer()`` before they build a task; a library user's process is left as
torch made it. Where torch's layout is not the one expected, ``defer()`` changes nothing.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

_MARK = "__dynamo_disable"  # where torch._compile._disable_dynamo caches a function's marked version


def _dynamo_loaded() -> bool:
    return "torch._dynamo" in sys.modules


def _marked_when_loaded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` itself until torch._dynamo is loaded, then ``torch._dynamo.disable(fn)``, as torch would."""
    marked: list[Callable[..., Any]] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not marked:
            if not _dynamo_loaded():
                return fn(*args, **kwargs)
            import torch._dynamo

            marked.append(torch._dynamo.disable(fn, True, wrapping=False))
        return marked[0](*args, **kwargs)

    return call


def _step_without_graph_breaks(step: Callable[..., Any]) -> Callable[..., Any]:
    """torch's ``_use_grad`` step wrapper (torch.optim.optimizer._use_grad_for_differentiable), with its
    graph breaks left out until torch._dynamo is loaded."""
    import torch

    func = step.__wrapped__

    @functools.wraps(func)
    def fast_step(*args: Any, **kwargs: Any) -> Any:
        if _dynamo_loaded():
            return step(*args, **kwargs)
        prev = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(args[0].defaults["differentiable"])
            return func(*args, **kwargs)
        finally:
            torch.set_grad_enabled(prev)

    return fast_step


def defer() -> None:
    """Let torch's optimizers train without importing torch._dynamo (the module docstring says how)."""
    if _dynamo_loaded():
        return
    try:
        import torch.optim

        optimizer = sys.modules["torch.optim.optimizer"]
        base = optimizer.Optimizer
        marked = [base.add_param_group, base.zero_grad, base.state_dict, base.load_state_dict]
        marked.append(sys.modules["torch.optim.adam"].adam)  # torch.optim.adam also names that function
        use_grad = optimizer._use_grad_for_differentiable(lambda: None).__code__
    except (ImportError, AttributeError, KeyError):
        return
    for wrapped in marked:
        fn = getattr(wrapped, "__wrapped__", None)
        if fn is not None and getattr(fn, _MARK, None) is None:
            setattr(fn, _MARK, _marked_when_loaded(fn))
    for name in torch.optim.__all__:
        cls = getattr(torch.optim, name, None)
        step = getattr(cls, "step", None)
        if not (isinstance(cls, type) and issubclass(cls, base) and callable(step)):
            continue
        # torch wraps a class's step once more (profiling hooks) when its first optimizer is built: leave
        # a class that already has one alone
        if getattr(step, "__code__", None) is use_grad and not getattr(step, "hooked", False):
            cls.step = _step_without_graph_breaks(step)
