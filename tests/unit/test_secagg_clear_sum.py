"""A secure sum's arithmetic in the clear (fedmq/secagg/clear_sum.py): FedAvg over the clients' quantized
uploads is the mean a SecAgg+ server would unmask from the same quantized inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedmq.errors import BadParameter
from fedmq.hooks import ClientContext, stable_seed
from fedmq.secagg.clear_sum import QuantizedUpload
from fedmq.secagg.quantize import Quantizer
from fedmq.tasks.base import TrainResult

SHAPES = {"w": (7, 5), "b": (5,)}


def _upload(hook: QuantizedUpload, client: str, trained: dict, n: int) -> dict:
    hook.context = ClientContext(client, 3, 2, 11, held={k: torch.zeros(s) for k, s in SHAPES.items()})
    return hook.finish(trained, TrainResult(1.0, n, 1, n, 0.1), kept=None)  # type: ignore[arg-type]


def test_fedavg_of_the_uploads_is_the_secure_mean_of_the_same_quantized_inputs():
    clip, m, n_max = 0.5, 10, 400
    hook, q = QuantizedUpload(clip, m, n_max), Quantizer.for_clients(m, clip)
    gen = torch.Generator().manual_seed(0)
    clients = [f"c{i}" for i in range(m)]
    trained = {c: {k: 0.4 * torch.randn(s, generator=gen) for k, s in SHAPES.items()} for c in clients}
    n = {c: 50 + 30 * i for i, c in enumerate(clients)}
    uploads = {c: _upload(hook, c, trained[c], n[c]) for c in clients}
    # FedAvg: Σ n_k Δ̂_k / Σ n_k
    fedavg = {k: sum(n[c] * uploads[c][k].double() for c in clients) / sum(n.values()) for k in SHAPES}
    # the server: the decoded sum of the clients' quantized w_k · clip(Δ_k), over Σ w_k
    total = {k: np.zeros(int(np.prod(s)), dtype=np.uint32) for k, s in SHAPES.items()}
    for c in clients:
        rng = np.random.default_rng(stable_seed(11, c, 3, "clear-sum"))
        w = n[c] / n_max
        for k in SHAPES:  # the hook's order: the tensors in the order it was given them
            delta = trained[c][k].double().numpy().reshape(-1)
            total[k] += q.encode(np.clip(delta, -clip, clip) * w, rng)
    weights = sum(n[c] / n_max for c in clients)
    for k, s in SHAPES.items():
        secure = torch.from_numpy(q.decode_sum(total[k], m) / weights).reshape(s)
        assert torch.allclose(fedavg[k], secure, rtol=0, atol=1e-6), k
    # the test has teeth for clipping: some coordinates were beyond c
    assert any((t.abs() > clip).any() for state in trained.values() for t in state.values())


def test_each_upload_is_within_one_step_over_its_weight_of_its_clipped_update_and_repeats():
    clip, n_max = 0.5, 400
    hook, q = QuantizedUpload(clip, 100, n_max), Quantizer.for_clients(100, clip)
    trained = {k: torch.linspace(-1, 1, int(np.prod(s))).reshape(s) for k, s in SHAPES.items()}
    first, again = _upload(hook, "c1", trained, 100), _upload(hook, "c1", trained, 100)
    for k in SHAPES:
        assert torch.equal(first[k], again[k])
        error = (first[k].double() - trained[k].double().clamp(-clip, clip)).abs().max()
        assert error <= q.step / (100 / n_max) + 1e-7
    other = _upload(hook, "c2", trained, 100)
    assert not all(torch.equal(first[k], other[k]) for k in SHAPES)  # its own rounding draws


@pytest.mark.parametrize(
    "args, words",
    [((0.0, 10, 100), "clipping range"), ((1.0, 2**25, 100), "bits"), ((1.0, 10, 0), "max_samples")],
)
def test_bad_parameters_are_one_line(args, words):
    with pytest.raises(BadParameter, match=words):
        QuantizedUpload(*args)
