"""Rewards for Flow-GRPO: ``reward(samples, prompts) -> [B]`` float32 tensor, one scalar per sample.

``samples`` is what the trainer hands over after the rollout: the final latents ``[B, C, H, W]``, or, when the
trainer is given a ``decode`` function (e.g. a VAE decode), the decoded images ``[B, 3, H', W']`` in ``[-1, 1]``.
``prompts`` is the list of the samples' prompts (any objects; a reward may ignore them). A reward is computed
without gradients and must not depend on the batch it is computed in (one value per sample, from that sample).

Built-in: ``LatentMeanReward``, ``- |mean(x) - target|`` with the mean over (a subset of) channels and all
positions. Why a tiny randomly initialised model learns it on CPU within ~20 updates:

* It depends on a single linear statistic of the final latent. The final latent is the initial noise plus
  ``sum_i v_i (sigma_{i+1} - sigma_i)`` with ``sum (sigma_{i+1} - sigma_i) = -1``, so ANY constant offset ``b`` the
  model adds to its velocity moves the statistic by ``-b``: the output projection's bias (or a LoRA on the output
  projection) is a one-parameter direction that solves the task, and gradient descent finds it immediately.
* The SDE noise of the window steps changes the statistic from sample to sample of the same prompt, so a group has
  spread-out rewards and the group advantages carry a signal (the log-prob of a step is exactly the Gaussian whose
  mean the velocity shifts).
* With ``target`` a few tenths away from the random model's typical mean (about 0), the reward is monotone in the
  statistic over the whole range the samples start in: no local optimum to get stuck in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Reward", "LatentMeanReward", "check_rewards"]


@runtime_checkable
class Reward(Protocol):
    """A reward: ``__call__(samples, prompts) -> [B]`` float tensor (see the module docstring)."""

    def __call__(self, samples: torch.Tensor, prompts: Sequence[Any]) -> torch.Tensor: ...


class LatentMeanReward:
    """``-|mean_{channels, positions}(samples) - target|`` per sample (``channels=None``: all channels)."""

    def __init__(self, target: float = 1.0, channels: Sequence[int] | None = None):
        self.target = float(target)
        self.channels = None if channels is None else list(channels)

    @torch.no_grad()
    def __call__(self, samples: torch.Tensor, prompts: Sequence[Any] = ()) -> torch.Tensor:
        x = samples.float()
        if self.channels is not None:
            x = x[:, self.channels]
        return -(x.mean(dim=tuple(range(1, x.ndim))) - self.target).abs()


def check_rewards(rewards: Any, batch_size: int) -> torch.Tensor:
    """``rewards`` as a detached fp32 ``[B]`` tensor; raises on a wrong shape or non-finite values."""
    r = torch.as_tensor(rewards).detach().float().reshape(-1)
    if r.shape != (batch_size,):
        raise ValueError(f"a reward must return one value per sample ({batch_size}), got shape {tuple(r.shape)}")
    if not torch.isfinite(r).all():
        raise ValueError(f"non-finite rewards: {r.tolist()}")
    return r
