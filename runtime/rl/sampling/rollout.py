"""In-process diffusers rollout for Flow-GRPO (the embedded default rollout adapter).

Each sample ``i`` has its own ``torch.Generator`` (seeded by the caller, e.g. from prompt id and repeat), which
draws, in this order: the window start (uniform in ``[window_start_min, window_start_max]``), the initial latents,
then one noise tensor per step. A sample's trajectory therefore does not depend on the batch it was rolled out in.
Steps ``start_i .. start_i + W - 1`` are stochastic (``noise_level``), the others run as the ODE (noise level 0:
the Euler step, bitwise). The result keeps, per sample, the ``W + 1`` latents around its window, the window's step
indices and timesteps, and the rollout log-probs, which is what the trainer needs to recompute ``log p`` per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runtime.rl.sampling.scheduler import FlowMatchSchedule

__all__ = ["RolloutResult", "rollout"]


@dataclass
class RolloutResult:
    latents: torch.Tensor  # [B, W + 1, C, H, W]: latents entering window step j at [:, j], the last leaves it
    step_indices: torch.Tensor  # [B, W] long: the schedule index of each window step
    timesteps: torch.Tensor  # [B, W] fp32: schedule.timesteps[step_indices]
    log_probs: torch.Tensor  # [B, W] fp32: rollout log-prob of each window step
    final_latents: torch.Tensor  # [B, C, H, W]: the end of the trajectory (to decode and reward)
    schedule: FlowMatchSchedule


@torch.no_grad()
def rollout(
    adapter: Any,
    module: nn.Module,
    batch: dict[str, Any],
    *,
    latent_shape: Sequence[int],
    num_inference_steps: int,
    window_size: int,
    generators: Sequence[torch.Generator],
    window_start_range: tuple[int, int] | None = None,
    noise_level: float | None = None,
    initial_latents: torch.Tensor | None = None,
) -> RolloutResult:
    """Sample one trajectory per sample with ``adapter.step`` (see the module docstring).

    ``batch`` holds the conditioning (the adapter's keys); its ``schedule`` is set here from
    ``adapter.set_timesteps``. ``window_start_range`` is inclusive and defaults to ``(0, N - window_size)``.
    ``initial_latents`` (``[B, *latent_shape]``): the starting noise instead of each generator's second draw (DanceGRPO
    shares it within a group); the generators then draw the window start and the SDE noise only.
    """
    schedule = adapter.set_timesteps(num_inference_steps)
    n = schedule.num_steps
    b = len(generators)
    if not 1 <= window_size <= n:
        raise ValueError(f"window_size must be in [1, {n}], got {window_size}")
    lo, hi = window_start_range if window_start_range is not None else (0, n - window_size)
    if not 0 <= lo <= hi <= n - window_size:
        raise ValueError(f"window_start_range {(lo, hi)} must lie in [0, {n - window_size}]")
    a = adapter.noise_level if noise_level is None else noise_level
    device = next(module.parameters()).device
    batch = {**batch, "schedule": schedule.to(device)}

    starts = torch.stack([torch.randint(lo, hi + 1, (), generator=g, device=g.device).cpu() for g in generators])
    if initial_latents is None:
        x = torch.stack([torch.randn(tuple(latent_shape), generator=g, device=g.device) for g in generators])
    else:
        x = initial_latents.float()
    x = x.to(device)
    steps = torch.arange(window_size)
    step_indices = starts[:, None] + steps[None, :]  # [B, W]

    kept = [None] * b  # per sample: list of W + 1 latents
    log_probs = torch.zeros(b, window_size)
    for i in range(n):
        in_window = (starts <= i) & (i < starts + window_size)
        levels = torch.where(in_window, torch.tensor(float(a)), torch.tensor(0.0)).to(device)
        prev, lp, _, _, _ = adapter.step(module, batch, x, i, noise_level=levels, generator=generators)
        for s in range(b):
            j = i - int(starts[s])
            if 0 <= j < window_size:
                if j == 0:
                    kept[s] = [x[s]]
                kept[s].append(prev[s])
                log_probs[s, j] = lp[s].cpu()
        x = prev
    latents = torch.stack([torch.stack(k) for k in kept])
    timesteps = schedule.timesteps[step_indices]
    return RolloutResult(latents, step_indices, timesteps, log_probs, x, schedule)
