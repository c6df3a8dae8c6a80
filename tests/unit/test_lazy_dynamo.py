"""fedmq.tasks.lazy_dynamo: torch's optimizers train without importing torch._dynamo, to the same bits, and
behave as torch made them once torch._dynamo is loaded (as torch.compile loads it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TRAIN = """
import json, sys, torch
if {defer}:
    from fedmq.tasks import lazy_dynamo
    lazy_dynamo.defer()
torch.manual_seed(0)
out = {{}}
for name, make in (("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
                   ("adam", lambda p: torch.optim.Adam(p, lr=0.01))):
    model = torch.nn.Linear(5, 3)
    opt = make(model.parameters())
    for i in range({steps}):
        if i == {dynamo_at}:
            import torch._dynamo  # as torch.compile does
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.arange(10.0).reshape(2, 5)), torch.ones(2, 3)).backward()
        opt.step()
    opt.load_state_dict(opt.state_dict())
    out[name] = [v.double().flatten().tolist() for v in model.state_dict().values()]
out["dynamo"] = "torch._dynamo" in sys.modules
out["sympy"] = "sympy" in sys.modules
print(json.dumps(out))
"""


def _train(defer: bool, steps: int = 4, dynamo_at: int = -1) -> dict:
    code = TRAIN.format(defer=defer, steps=steps, dynamo_at=dynamo_at)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def torch_as_made() -> dict:
    return _train(defer=False)


def test_training_never_imports_dynamo_and_gives_the_same_bits(torch_as_made):
    deferred = _train(defer=True)
    assert torch_as_made["dynamo"] and torch_as_made["sympy"]  # what defer() saves: torch imports both
    assert not deferred["dynamo"] and not deferred["sympy"]
    assert deferred["sgd"] == torch_as_made["sgd"] and deferred["adam"] == torch_as_made["adam"]


def test_once_dynamo_is_loaded_the_optimizers_are_torchs_own(torch_as_made):
    loaded = _train(defer=True, dynamo_at=2)
    assert loaded["dynamo"]
    assert loaded["sgd"] == torch_as_made["sgd"] and loaded["adam"] == torch_as_made["adam"]
