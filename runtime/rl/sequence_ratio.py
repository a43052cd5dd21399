"""The sequence-level log-ratio of GSPO (``policy_loss_mode: gspo``, ``runtime/rl/algorithms/objectives.py``): each
sample's mean of ``log p_theta - log p_old`` over the steps it trains this iteration, under the epoch's weights.

Why a pass of its own. The loop backpropagates one window step of one micro-batch at a time (a sample's steps are
separate forwards, their graphs never held together), but a sample's sequence ratio needs all its steps' log-probs
before the first step's loss. The weights do not change within an epoch (one optimizer update per epoch), so a
no-grad pass over the epoch's steps, in the epoch's own micro-batch layout (its log-probs bitwise those of the
training forwards), gives the ratio's value; the training pass then carries its gradient step by step. Its cost: one
more forward (without grad) per trained step and epoch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from runtime.rl.batch import select_rows

if TYPE_CHECKING:
    from runtime.rl.run_state import RLRun
    from runtime.rl.sampling.rollout import RolloutResult

__all__ = ["sequence_log_ratios"]


def sequence_log_ratios(
    run: RLRun,
    res: RolloutResult,
    train_batch: dict,
    order: torch.Tensor,
    positions: torch.Tensor | None,
    k: int,
    mb: int,
    anchor: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B]`` (CPU, float32): each sample's ``mean_j(log p - anchor)`` over its ``k`` trained steps (``positions``,
    or the first ``k`` window steps), the forwards in the epoch's layout (``order`` in chunks of ``mb``). ``anchor``
    ``[B, k]``: the old log-probs the ratio is taken against; None: the rollout's."""
    s, adapter, module = run.config.algo, run.policy.adapter, run.policy.module
    b, device = res.latents.shape[0], res.final_latents.device
    total = torch.zeros(b, dtype=torch.float64)
    with torch.no_grad():
        for j in range(k):
            for start in range(0, b, mb):
                rows = order[start : start + mb]
                col = j if positions is None else positions[rows, j]
                x, prev = res.latents[rows, col].to(device), res.latents[rows, col + 1].to(device)
                levels = torch.full((len(rows),), float(s.noise_level), device=device)
                log_prob = adapter.forward_and_sample_previous_step(
                    module,
                    select_rows(train_batch, rows),
                    x,
                    res.step_indices[rows, col].to(device),
                    prev_sample=prev,
                    noise_level=levels,
                )[0]
                old = res.log_probs[rows, col] if anchor is None else anchor[rows, j]
                total[rows] += (log_prob.detach().cpu() - old.cpu()).double()
    return (total / k).float()
