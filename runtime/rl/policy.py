"""The policy of an RL run on a generated DiT: the transformer from the pipeline's ``transformer/`` (LoRA through
peft or full fine-tuning, FSDP2 + Ulysses SP when distributed, optional EMA), its frozen condition model, the
Flow-GRPO adapter that drives both, and the reference the KL is measured against.

Everything is the supervised DiT trainer's (``runtime/train/dit.py``): the same loading (unexpected weights refused),
LoRA injection (A seeded alike on every rank), FSDP wrapping, EMA, checkpointed module (the adapter only for LoRA)
and export. What is RL's own: the reference (``lora_disabled``: the policy with its LoRA turned off, no memory;
``frozen_copy``: a frozen copy of the starting weights, sharded like the policy) and the identity a checkpoint
records (the transformer, the LoRA settings and the algorithm: a supervised checkpoint does not resume an RL run).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runtime.checkpoint.identity import model_identity
from runtime.parallel.state import ParallelState
from runtime.train.config import ConfigError

__all__ = ["Policy", "build_dit_policy", "lora_disabled"]


@dataclass
class Policy:
    module: nn.Module  # the trained transformer (FSDP2-sharded when distributed)
    adapter: Any  # runtime.flowgrpo.dit.DiTFlowGRPO
    reference: nn.Module | None  # a frozen copy, or None (lora_disabled, or no KL)
    peft_config: Any  # None for full fine-tuning
    ema: Any
    checkpoint_module: nn.Module  # what checkpoints save (runtime.train.dit.checkpointed)
    identity: dict[str, Any]

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]


@contextlib.contextmanager
def lora_disabled(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` as its base model (every peft LoRA layer off) inside the block; back on after it."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ValueError(f"{type(module).__name__} has no LoRA layers to disable")
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield module
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def _check_sampling(condition_model: Any, config: Any) -> None:
    from runtime.diffusion.conditions import ConditionModel

    if type(condition_model).encode_prompts is ConditionModel.encode_prompts:
        raise ConfigError(
            f"model.type: the condition model of {config.model.type!r} ({type(condition_model).__name__}) states no "
            f"sampling facts yet (runtime/diffusion/conditions: sampling_latent_shape, encode_prompts, ...)"
        )
    if getattr(condition_model, "i2v", False):
        raise ConfigError(
            f"model.path: {config.model.path} is an image-to-video pipeline; RL runs sample from prompts alone "
            f"(use a text-to-video pipeline)"
        )


def build_dit_policy(config: Any, state: ParallelState, device: torch.device) -> Policy:
    """The policy of ``config`` (an ``RLConfig``) on ``device``, sharded over ``state``'s ranks."""
    from runtime.flowgrpo.dit import adapter_for
    from runtime.parallel.fsdp import apply_fsdp
    from runtime.train.dit import (
        check_transformer,
        checkpointed,
        load_condition_model_for,
        load_transformer,
        quiet_loading,
    )

    quiet_loading()
    check_transformer(config, state.sp_size)  # sp divides the heads; the LoRA targets adapt something
    condition_model = load_condition_model_for(config, encoders=True, device=device)
    _check_sampling(condition_model, config)
    s = config.sampling
    latent_shape = condition_model.sampling_latent_shape(s.height, s.width, s.frames)
    algo = config.algo
    adapter = adapter_for(config.model.type)(
        condition_model,
        latent_shape,
        true_cfg_scale=s.true_cfg_scale,
        noise_level=algo.noise_level,
        method=algo.sde_type,
        cps_log_prob=algo.cps_log_prob,
    )

    module = load_transformer(config)
    peft_config = None
    if config.dit.lora.rank is not None:
        from runtime.train.lora import add_lora

        torch.manual_seed(config.model.seed)  # the adapter's initial A: identical on every rank
        peft_config = add_lora(module, config.dit.lora)
    reference = None
    if algo.kl_coef > 0 and config.reference == "frozen_copy":
        reference = copy.deepcopy(module).requires_grad_(False).eval()
    module.to(device)
    if state.world_size > 1:
        module = apply_fsdp(module, state, activation_checkpointing=config.parallel.activation_checkpointing)
        if reference is not None:
            reference = apply_fsdp(reference.to(device), state)
    else:
        if config.parallel.activation_checkpointing:
            module.gradient_checkpointing_enable()
        if reference is not None:
            reference.to(device)
    if not any(p.requires_grad for p in module.parameters()):
        raise ConfigError("dit.lora: the policy has no trainable parameter; nothing would be trained")
    ema = None
    if config.dit.ema_decay is not None:
        from runtime.train.ema import EMA

        ema = EMA(module, config.dit.ema_decay).to(device)
    lora = config.dit.lora
    identity = model_identity(
        config.model.type,
        {
            "transformer": module.config,
            "lora": None
            if lora.rank is None
            else {"rank": lora.rank, "alpha": lora.alpha, "targets": lora.target_modules},
            "algorithm": config.algorithm,
        },
    )
    return Policy(
        module=module,
        adapter=adapter,
        reference=reference,
        peft_config=peft_config,
        ema=ema,
        checkpoint_module=checkpointed(module, ema, lora=peft_config is not None) or module,
        identity=identity,
    )
