"""The optimizer and learning-rate schedule of every trainer (text, VLM and omni models and DiTs through
``run_job``, the RL job), built from the ``optim`` section by the libraries an HF Trainer user knows, so that a name
means what it means there.

``optim.name`` (HF TrainingArguments' ``optim`` values):

* ``adamw_torch``: ``torch.optim.AdamW``; torch picks the multi-tensor (foreach) implementation where it has one
  (CUDA) and the per-parameter loop elsewhere.
* ``adamw_torch_fused``: ``torch.optim.AdamW(fused=True)`` (CPU and CUDA kernels in torch 2.13); refused in one line
  on a device without a fused kernel.
* ``adafactor``: ``transformers.optimization.Adafactor`` with ``optim.lr`` as given (``relative_step``,
  ``scale_parameter`` and ``warmup_init`` off, as HF Trainer sets them); it reads ``lr`` and ``weight_decay`` only.
  One process only: its factored second moment (row and column means of each gradient) is kept in plain tensors,
  which it then mixes with FSDP2's sharded (DTensor) gradients; refused in one line on more ranks.
* ``sgd``: ``torch.optim.SGD`` without momentum, as HF Trainer's ``sgd``; it reads ``lr`` and ``weight_decay`` only
  (``betas[0]`` is not turned into a momentum: the same key would then mean two things).

``optim.lr_scheduler_type`` goes to ``transformers.get_scheduler`` with ``warmup_steps``, ``train.steps`` and, for
``cosine_with_min_lr``, ``min_lr_rate = min_lr_ratio``. Its warmup is transformers' formula: the multiplier of
optimizer step ``s`` (0-based) is ``s / warmup_steps``, so the first step runs at lr 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from runtime.config.common import OPTIMIZERS, SCHEDULERS, OptimConfig
from runtime.config.errors import ConfigError

__all__ = ["build_optimizer", "build_scheduler"]


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer ``optim.name`` over ``params`` (the trained ones: frozen parts are left out by the caller)."""
    params = list(params)
    if not math.isfinite(optim.lr):  # AdamW refuses NaN with a traceback and takes inf; neither may train
        raise ConfigError(f"optim.lr: {optim.lr} is not a finite number")
    name = optim.name
    if name in ("adamw_torch", "adamw_torch_fused"):
        fused = name == "adamw_torch_fused"
        if fused:
            _check_fused_devices(params)
        return torch.optim.AdamW(
            params,
            lr=optim.lr,
            betas=tuple(optim.betas),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            fused=True if fused else None,
        )
    if name == "adafactor":
        from torch.distributed.tensor import DTensor
        from transformers.optimization import Adafactor

        if any(isinstance(p, DTensor) for p in params):
            raise ConfigError(
                "optim.name: adafactor (transformers' Adafactor) cannot step FSDP2-sharded parameters (its factored "
                "statistics are plain tensors); use adamw_torch, or adafactor in a one-process run"
            )

        return Adafactor(
            params,
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            scale_parameter=False,
            relative_step=False,
            warmup_init=False,
        )
    if name == "sgd":
        return torch.optim.SGD(params, lr=optim.lr, weight_decay=optim.weight_decay)
    raise ConfigError(f"optim.name: expected one of {', '.join(OPTIMIZERS)}, found {name!r}")


def _check_fused_devices(params: list[torch.nn.Parameter]) -> None:
    """torch checks fused support only at the first step (a traceback mid-run); probe each device up front with one
    fused step on a one-element tensor."""
    for device in {p.device for p in params}:
        probe = torch.zeros(1, device=device, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        try:
            torch.optim.AdamW([probe], fused=True).step()
        except RuntimeError as exc:
            reason = " ".join(str(exc).split())[:200]
            raise ConfigError(
                f"optim.name: adamw_torch_fused has no fused kernel for {device.type} parameters here ({reason}); "
                f"use adamw_torch"
            ) from None


def build_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """``transformers.get_scheduler(optim.lr_scheduler_type)`` over ``total_steps`` optimizer steps."""
    name = optim.lr_scheduler_type
    if name not in SCHEDULERS:
        raise ConfigError(f"optim.lr_scheduler_type: expected one of {', '.join(SCHEDULERS)}, found {name!r}")
    from transformers import get_scheduler

    extra = {"min_lr_rate": optim.min_lr_ratio} if name == "cosine_with_min_lr" else None
    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=optim.warmup_steps,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=extra,
    )
