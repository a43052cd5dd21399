"""Rewards the RL tests name by import path (``callable: tests.rl.rewards:<name>``)."""

from __future__ import annotations

import torch


def brightness(samples: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Mean pixel value per sample: a reward the tiny models can move."""
    return samples.float().flatten(1).mean(dim=1)


def redness(samples: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Red minus the other channels, per sample."""
    x = samples.float()
    return (x[:, 0] - x[:, 1:].mean(dim=1)).flatten(1).mean(dim=1)


class PromptLength:
    """A class reward: built once with its kwargs."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def __call__(self, samples: torch.Tensor, prompts: list[str]) -> list[float]:
        return [self.scale * len(p) for p in prompts]


def wrong_count(samples: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """One value too few: a broken reward the job must refuse."""
    return torch.zeros(len(prompts) - 1)


def constant(samples: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """The same reward for every sample: advantages all 0, nothing to learn."""
    return torch.ones(len(prompts))


def not_finite(samples: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    out = torch.zeros(len(prompts))
    out[0] = float("nan")
    return out


def raises(samples: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    raise RuntimeError("the reward model ran out of memory")
