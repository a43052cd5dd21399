"""Noise-level sampling of the condition models: the formulas of each recipe, on the same uniform/normal draws."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.diffusion.timesteps import TimestepSampler


def _u(seed: int, n: int, logit: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(n, generator=g)) if logit else torch.rand(n, generator=g)


def test_uniform_shifted() -> None:
    sigmas = TimestepSampler(shift=5.0).sample(64, generator=torch.Generator().manual_seed(0))
    u = _u(0, 64).double()
    assert torch.allclose(sigmas.double(), 5 * u / (1 + 4 * u), atol=1e-6)
    assert sigmas.mean() > 0.7  # shifted towards noise


def test_logit_normal_with_resolution_dependent_shift() -> None:
    sampler = TimestepSampler(distribution="logit_normal", dynamic=True, max_shift=1.15)
    sigmas = sampler.sample(64, seq_len=1024, generator=torch.Generator().manual_seed(1))
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (1024 - 256)
    u = _u(1, 64, logit=True).double()
    assert torch.allclose(sigmas.double(), math.exp(mu) / (math.exp(mu) + 1 / u - 1), atol=1e-6)


def test_from_scheduler_config() -> None:
    assert TimestepSampler.from_scheduler_config({"shift": 3.0}).shift == 3.0
    assert TimestepSampler.from_scheduler_config({"flow_shift": 5.0, "shift": None}).shift == 5.0
    flux = {"use_dynamic_shifting": True, "base_image_seq_len": 256, "max_image_seq_len": 4096, "max_shift": 1.15}
    sampler = TimestepSampler.from_scheduler_config(flux, distribution="logit_normal")
    assert sampler.dynamic and sampler.shift == 1.0 and sampler.distribution == "logit_normal"


def test_bad_distribution() -> None:
    with pytest.raises(ValueError, match="'uniform' or 'logit_normal'"):
        TimestepSampler(distribution="cosine")
