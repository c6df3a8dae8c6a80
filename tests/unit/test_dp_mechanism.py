"""The Gaussian mechanism of DP-FedAvg (fedmq.privacy.mechanism) and client mode's noise share
(fedmq.privacy.client_dp): clipped norms, noise scales, and where the noise comes from."""

from __future__ import annotations

import math

import pytest
import torch

from fedmq.hooks import ClientContext
from fedmq.privacy.client_dp import ClientDP, share_std
from fedmq.privacy.mechanism import add_gaussian, clip, noise_generator, plausible_norm, update_norm
from fedmq.tasks.base import TrainResult


def _update(seed: int, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": scale * torch.randn(300, 20, generator=g), "b": scale * torch.randn(7, generator=g)}


@pytest.mark.parametrize("bound", [0.01, 0.5, 3.0, 1e3])
def test_every_clipped_update_is_within_the_bound(bound):
    for seed in range(20):
        update = _update(seed, scale=10 ** (seed % 5 - 2))
        clipped, norm = clip(update, bound)
        assert update_norm(clipped) <= bound * (1 + 1e-6)
        assert norm == pytest.approx(update_norm(update))
        if norm <= bound:  # within the bound: unchanged
            assert all(torch.equal(clipped[k], update[k]) for k in update)
        else:  # beyond it: scaled onto the sphere, direction kept
            assert update_norm(clipped) == pytest.approx(bound, rel=1e-5)
            assert torch.allclose(clipped["a"] * norm / bound, update["a"], rtol=1e-4, atol=1e-6)


def test_the_norm_is_one_l2_over_every_tensor():
    update = {"x": torch.full((4,), 3.0), "y": torch.full((9,), 4.0 / 3)}  # 36 + 16 = 52
    assert update_norm(update) == pytest.approx(math.sqrt(52))


def test_added_noise_has_the_standard_deviation_asked():
    tensors = {"w": torch.zeros(2_000_000)}
    add_gaussian(tensors, 0.37, noise_generator(7, "test"))
    assert float(tensors["w"].std()) == pytest.approx(0.37, rel=0.02)
    assert abs(float(tensors["w"].mean())) < 0.37 * 0.01


def test_seeded_noise_repeats_and_the_secure_source_does_not():
    a, b = noise_generator(3, "dp", 1), noise_generator(3, "dp", 1)
    assert torch.equal(torch.randn(50, generator=a), torch.randn(50, generator=b))
    other = noise_generator(3, "dp", 2)
    assert not torch.equal(
        torch.randn(50, generator=noise_generator(3, "dp", 1)), torch.randn(50, generator=other)
    )
    x, y = noise_generator(None), noise_generator(None)  # 63 bits of the OS CSPRNG each
    assert not torch.equal(torch.randn(50, generator=x), torch.randn(50, generator=y))


def _hook(clip_norm: float, std: float, seed: int | None = 1) -> ClientDP:
    hook = ClientDP(clip_norm=clip_norm, noise_std=std)
    held = {"w": torch.ones(1_000_000), "v": torch.zeros(10)}
    hook.context = ClientContext("agent-3", 2, 1, 0, held=held, noise_seed=seed)
    return hook


def test_client_mode_share_is_z_s_over_the_root_of_the_minimum_count():
    z, s, m = 1.2, 0.5, 9
    std = share_std(z, s, m)
    assert std == pytest.approx(z * s / 3)
    hook = _hook(s, std)
    held = hook.context.held
    trained = {"w": held["w"] + 5.0, "v": held["v"] - 1.0}  # far beyond S: clipped first
    out = hook.finish(trained, TrainResult(0.0, 1, 1, 1, 0.0), kept=None)  # type: ignore[arg-type]
    change = {k: out[k] - held[k] for k in out}
    # the clipped part is tiny per coordinate next to the noise: what is left is the share
    assert float(change["w"].std()) == pytest.approx(std, rel=0.02)
    # m shares sum to the full noise z·S
    assert math.sqrt(m) * std == pytest.approx(z * s)
    assert update_norm(change) <= plausible_norm(s, std, 1_000_010)


def test_client_mode_without_noise_uploads_the_clipped_change():
    hook = _hook(0.5, 0.0)
    held = hook.context.held
    trained = {"w": held["w"] + 0.01, "v": held["v"] + 2.0}
    out = hook.finish(trained, TrainResult(0.0, 1, 1, 1, 0.0), kept=None)  # type: ignore[arg-type]
    change = {k: out[k] - held[k] for k in out}
    assert update_norm(change) == pytest.approx(0.5, rel=1e-4)


def test_client_hook_refuses_bad_parameters():
    with pytest.raises(Exception, match="clip_norm"):
        ClientDP(clip_norm=0.0, noise_std=1.0)
    with pytest.raises(Exception, match="noise_std"):
        ClientDP(clip_norm=1.0, noise_std=-1.0)
