"""The finite check every kept state, partial sum and guard reads (fedmq/state_checks.py ``all_finite``): a
finite norm settles it in one pass, anything else is looked at element by element, so the verdict is
``torch.isfinite(t).all()``'s for every dtype."""

from __future__ import annotations

import warnings

import pytest
import torch

from fedmq.state_checks import all_finite, state_problem


def _cases() -> list[torch.Tensor]:
    big = torch.full((1000, 60), 60000.0, dtype=torch.float16)  # finite, but its float16 norm overflows
    cases = [big, torch.tensor([]), torch.arange(5), torch.tensor([True, False])]
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64):
        for bad in (None, float("nan"), float("inf"), -float("inf")):
            t = torch.linspace(-3, 3, 4099).to(dtype)
            if bad is not None:
                t[4098] = bad
            cases.append(t)
    return cases


@pytest.mark.parametrize("t", _cases(), ids=lambda t: f"{t.dtype}-{t.numel()}")
def test_the_verdict_is_isfinite_alls_for_every_dtype(t):
    assert all_finite(t) == bool(torch.isfinite(t).all())
    assert all_finite(t[::2]) == bool(torch.isfinite(t[::2]).all())  # a strided view


def test_a_tensor_that_needs_grad_is_judged_without_a_graph_or_a_warning():
    t = torch.ones(10, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all_finite(t)
        assert state_problem({"w": t}) is None


def test_a_state_names_its_non_finite_tensor_and_its_overflowing_norm():
    assert state_problem({"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")])}) == "b: not finite"
    assert "norm" in (state_problem({"w": torch.full((100,), 3e38)}) or "")
