"""A LoRA run's weights in the forms checkpoints and exports need: the adapter modules DCP saves, the adapter's
tensors under diffusers' LoRA-file names, and the base weights with the adapter merged. Pure state-dict work on
peft's naming (adapter ``default``: ``<module>.lora_A.default.weight`` / ``lora_B``, the adapted module's own weight
at ``<module>.base_layer.weight``); injecting adapters is the jobs' (``runtime/train/lora.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig

__all__ = ["ADAPTER", "adapter_modules", "lora_metadata", "lora_state_dict", "merged_state_dict"]

ADAPTER = "default"


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


def lora_metadata(config: PeftLoraConfig) -> dict[str, Any]:
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
    back), under the plain model's key names. Linear adapters only (a DiT's); transformers models merge through
    peft (``runtime/checkpoint/export.py``), which also merges adapted parameters."""
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
