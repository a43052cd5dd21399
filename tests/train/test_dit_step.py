"""The DiT step's randomness and loss weighting: per-sample generators (a sample's noise does not depend on its
batch), the generators' derivation, and the recipes' loss weights."""

from __future__ import annotations

import math

import torch

from runtime.diffusion.timesteps import TimestepSampler
from runtime.train.dit_step import noise_generators


def _gens(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_per_sample_generators_make_draws_independent_of_the_batch() -> None:
    sampler = TimestepSampler(shift=3.0)
    pair = sampler.sample(2, generator=_gens(1, 2))
    assert torch.equal(pair, torch.cat([sampler.sample(1, generator=_gens(1)), sampler.sample(1, generator=_gens(2))]))

    from runtime.diffusion.conditions.base import ConditionModel

    x = torch.zeros(2, 4, 3, 5)
    noise = ConditionModel.noise_like(None, x, _gens(1, 2))
    single = ConditionModel.noise_like(None, x[:1], _gens(2))
    assert torch.equal(noise[1:], single) and not torch.equal(noise[0], noise[1])


def test_noise_generators_are_keyed_by_seed_step_position_and_sample() -> None:
    def first(*key: int) -> float:
        return torch.rand(1, generator=noise_generators(*key[:3], key[3] + 1)[key[3]]).item()

    base = first(0, 5, 1, 0)
    assert first(0, 5, 1, 0) == base  # deterministic: SP ranks and a resumed run draw the same
    assert len({base, first(1, 5, 1, 0), first(0, 6, 1, 0), first(0, 5, 2, 0), first(0, 5, 1, 1)}) == 5


def test_bell_weighting_has_mean_one_and_vanishes_at_the_ends() -> None:
    for sampler in (
        TimestepSampler(shift=5.0, weighting="bell"),  # Wan's recipe
        TimestepSampler(distribution="logit_normal", dynamic=True, weighting="bell"),
    ):
        sigmas = sampler.sample(200_000, seq_len=1024, generator=torch.Generator().manual_seed(0))
        assert abs(sampler.loss_weight(sigmas, 1024).double().mean().item() - 1) < 0.01
        ends = sampler.loss_weight(torch.tensor([0.0, 0.5, 1.0]), 1024)
        assert ends[0].abs() < 1e-6 and ends[2].abs() < 1e-6 and ends[1] > 1
    flat = TimestepSampler(distribution="logit_normal").loss_weight(torch.tensor([0.1, 0.9]))
    assert torch.equal(flat, torch.ones(2))  # Flux / Qwen-Image: the density does the weighting
    # uniform sigma: the peak over the mean, (1 - e^-1/2) / (int_0^1 e^(-2(s-1/2)^2) ds - e^-1/2)
    mean = math.sqrt(math.pi / 2) * math.erf(1 / math.sqrt(2)) - math.exp(-0.5)
    peak = TimestepSampler(weighting="bell").loss_weight(torch.tensor([0.5])).item()
    assert math.isclose(peak, (1 - math.exp(-0.5)) / mean, rel_tol=1e-4)
