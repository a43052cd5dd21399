"""Shared pieces of the checkpoint tests: a deterministic little training loop on a tiny generated model."""

from __future__ import annotations

import math
from functools import partial

import torch

TOTAL_STEPS = 6
SAVE_AT = 3
LENGTHS = (9, 14, 7)


def warmup_cosine(step: int, warmup: int = 2, total: int = TOTAL_STEPS) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def build(model_type: str = "qwen3", seed: int = 0, state=None, **config_overrides):
    """(config, model, AdamW, LambdaLR); with a multi-rank ``state`` the model is sharded by ``apply_fsdp`` first."""
    from runtime.models.registry import causal_lm_class
    from runtime.models.tiny_configs import tiny_config

    config = tiny_config(model_type, **config_overrides)
    torch.manual_seed(seed)
    model = causal_lm_class(model_type)(config)
    if state is not None and state.world_size > 1:
        from runtime.parallel.fsdp import apply_fsdp

        apply_fsdp(model, state)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(warmup_cosine))
    return config, model, optimizer, scheduler


def batch(step: int, rank: int = 0, world_size: int = 1, vocab_size: int = 97) -> dict[str, torch.Tensor]:
    from runtime.models.tiny_configs import random_packed_batch

    return random_packed_batch(LENGTHS, vocab_size, seed=1000 + step * world_size + rank)


def train(model, optimizer, scheduler, start: int, stop: int, rank: int = 0, world_size: int = 1) -> list:
    """Steps ``start`` .. ``stop - 1``; returns each step's loss."""
    losses = []
    for step in range(start, stop):
        loss = model(**batch(step, rank, world_size)).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    return losses


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on rank 0 (empty elsewhere), as plain CPU tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def mlp(seed: int = 0):
    """(model, AdamW, LambdaLR) of a small MLP with dropout: the checkpoint mechanics without a transformers import."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(warmup_cosine))
    return model, optimizer, scheduler


def mlp_step(model, optimizer, scheduler, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
