"""LoRA through peft on a DiT transformer: adapters on the modules whose names match ``target_modules``, everything
else frozen; and the adapter's weights in the forms an export needs (diffusers' LoRA keys, or merged weights).

``target_modules`` follows peft: a list of names matches every module whose qualified name ends with one of them
(``to_q`` matches ``blocks.0.attn1.to_q``; ``attn1.to_q`` only self-attention), a string is a regular expression that
must match the whole qualified name. The adapter is named ``default``; its parameters are
``<module>.lora_A.default.weight`` / ``lora_B``, and the adapted module's own weight moves to
``<module>.base_layer.weight``.
"""

from __future__ import annotations

from typing import Any

import torch

from runtime.train.config import ConfigError, LoraConfig

__all__ = [
    "ADAPTER",
    "add_lora",
    "adapter_modules",
    "lora_metadata",
    "lora_state_dict",
    "merged_state_dict",
    "peft_lora_config",
]

ADAPTER = "default"
# ``lora.target_modules: null`` on a DiT: the attention projections every diffusers attention block has
DIT_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")


def peft_lora_config(settings: LoraConfig, default_targets: tuple[str, ...] = DIT_TARGET_MODULES) -> Any:
    from peft import LoraConfig as PeftLoraConfig

    rank = settings.rank
    targets = settings.target_modules if settings.target_modules is not None else list(default_targets)
    return PeftLoraConfig(
        r=rank,
        lora_alpha=settings.alpha if settings.alpha is not None else rank,
        target_modules=targets,
        target_parameters=settings.target_parameters,
        lora_dropout=settings.dropout,
        bias="none",
        init_lora_weights=True,  # A: Kaiming-uniform from torch's RNG (seeded alike on every rank), B: zeros
    )


def add_lora(model: torch.nn.Module, settings: LoraConfig) -> Any:
    """Inject the adapter into ``model`` in place, freeze everything but the adapter; returns the peft config."""
    from peft import inject_adapter_in_model

    config = peft_lora_config(settings)
    targets = config.target_modules  # peft keeps a list as a set
    targets = sorted(targets) if isinstance(targets, set) else targets
    model.requires_grad_(False)
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as exc:  # peft: no module matched target_modules
        first = " ".join(str(exc).split())[:200]
        raise ConfigError(f"lora.target_modules: {targets!r}: {first}") from None
    trained = 0
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
        trained += param.numel() if param.requires_grad else 0
    if not trained:
        raise ConfigError(f"lora.target_modules: {targets!r} adapted no module")
    return config


def adapter_modules(model: torch.nn.Module) -> torch.nn.Module:
    """The modules holding the trained (adapter) parameters, gathered under one module with the adapters'
    qualified names ("/" for "."): what a LoRA run checkpoints. The frozen base weights are left out (they come
    from ``model.path`` again on resume), so a checkpoint holds the adapter and its optimizer state only. The
    modules are shared, not copied: FSDP2's sharded parameters are saved and loaded in place."""
    owners = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            module_name = name.rpartition(".")[0]
            owners[module_name.replace(".", "/")] = model.get_submodule(module_name)
    return torch.nn.ModuleDict(owners)


def lora_metadata(config: Any) -> dict[str, Any]:
    """The peft config as JSON data: diffusers' ``load_lora_weights`` rebuilds the same adapter from it (rank,
    alpha, target modules), rather than guessing alpha from the weights."""
    data = config.to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in data.items()}


def lora_state_dict(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a full state dict, keyed as diffusers' LoRA files are (adapter name dropped):
    ``blocks.0.attn1.to_q.lora_A.weight``."""
    suffix = f".{ADAPTER}."
    return {k.replace(suffix, "."): v for k, v in full.items() if ".lora_A." in k or ".lora_B." in k}


def merged_state_dict(full: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A full state dict with the adapter merged into its base weights (``W + scaling * B @ A``, in float32 and cast
    back), under the plain model's key names."""
    out: dict[str, torch.Tensor] = {}
    for key, value in full.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        if ".base_layer." not in key:
            out[key] = value
            continue
        module, _, leaf = key.rpartition(".base_layer.")
        plain = f"{module}.{leaf}"
        if leaf == "weight":
            a = full[f"{module}.lora_A.{ADAPTER}.weight"].float()
            b = full[f"{module}.lora_B.{ADAPTER}.weight"].float()
            value = (value.float() + scaling * (b @ a)).to(value.dtype)
        out[plain] = value
    return out
