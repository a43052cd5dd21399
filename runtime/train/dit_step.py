"""One DiT training step: seeded noise, the condition model's ``process_condition``, the transformer, the recipe's
weighted flow-matching MSE.

**Noise.** Every sample gets its own ``torch.Generator``, seeded from ``(run seed, global step, q, i)``: ``q`` is
the micro-batch's place in the step's global batch (``micro_batch * dp_size + dp_rank``, the order in which
``BucketBatchSampler`` hands batches out) and ``i`` the sample's place in it. Its noise level and noise come from
it alone, so

* the SP ranks of a replica (same ``dp_rank``) draw identical noise and timesteps, as Ulysses SP requires;
* a resumed run draws what the uninterrupted run drew at that step (no generator state to save);
* ``dp_size`` ranks with ``m`` micro-batches draw, sample for sample, what one process with ``dp_size * m``
  micro-batches draws.

**Loss.** Per sample ``w(sigma) * mean((prediction - (noise - x0))^2)`` in float32, where ``w`` is the model's
recipe (``ConditionModel.loss_weight``). Every rank's loss is its share of the global mean over the samples of the
step's global batch (divided by their total count), so gradients summed over all ranks are the gradients of that
mean; SP ranks compute the same share from the same gathered prediction, and their partial gradients add up to the
single-process ones (``runtime/diffusion/sp.py``).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch

__all__ = ["latent_tokens", "noise_generators", "weighted_flow_matching_loss"]


def noise_generators(seed: int, step: int, position: int, count: int) -> list[torch.Generator]:
    """The generators of the ``count`` samples of the micro-batch at ``position`` of step ``step``'s global batch."""
    gens = []
    for index in range(count):
        digest = hashlib.sha256(f"patchgen.dit.noise:{seed}:{step}:{position}:{index}".encode()).digest()
        gens.append(torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)))
    return gens


def latent_tokens(latents: torch.Tensor, patch: tuple[int, ...] = (2, 2)) -> int:
    """Transformer tokens of one sample's latents ``(C, F, H, W)`` or ``(C, H, W)``: ``patch`` over the trailing
    dims (the condition model's ``patch``: Wan's (1, 2, 2), Flux's and Qwen-Image's 2x2 packing), the other dims after
    the first taken whole."""
    shape = latents.shape[1:]
    lead, tail = shape[: len(shape) - len(patch)], shape[len(shape) - len(patch) :]
    return math.prod(lead) * math.prod(size // p for size, p in zip(tail, patch, strict=True))


def weighted_flow_matching_loss(
    prediction: torch.Tensor, inputs: Any, condition_model: Any, seq_len: int, denominator: int
) -> torch.Tensor:
    """``sum_i w(sigma_i) * mse_i / denominator`` over the micro-batch (float32). A condition model's ``loss_mask``
    (0 where the latents are given, not predicted: Wan2.2 TI2V's first frame) restricts each ``mse_i`` to the rest."""
    target = inputs.target.to(prediction.device)
    squared = (prediction.float() - target.float()).pow(2).flatten(1)
    mask = getattr(inputs, "loss_mask", None)
    if mask is None:
        per_sample = squared.mean(dim=1)
    else:
        mask = mask.to(squared).flatten(1)
        per_sample = (squared * mask).sum(dim=1) / mask.sum(dim=1)
    weights = condition_model.loss_weight(inputs.sigmas, seq_len).to(per_sample.device)
    return (weights * per_sample).sum() / denominator
