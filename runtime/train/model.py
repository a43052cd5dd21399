"""Build the generated model a run trains: from a local HF checkpoint or randomly initialised from a config."""

from __future__ import annotations

from typing import Any

import torch
import transformers

from runtime.models.registry import lookup
from runtime.moe.dispatch import register_experts_kernels
from runtime.train.config import ConfigError, ModelConfig


def build_model(cfg: ModelConfig, fixed: dict[str, Any] | None = None) -> torch.nn.Module:
    """``fixed``: config values the data dictates (a VLM's special-token ids from its processor): set on a random
    init, checked against a checkpoint's config."""
    register_experts_kernels()
    fixed = fixed or {}
    try:
        entry = lookup(cfg.type)
    except ValueError as exc:
        raise ConfigError(f"model.type: {exc}") from None
    cls = entry.model_class()
    moe = {"experts_implementation": cfg.experts_implementation} if entry.is_moe else {}
    if cfg.path is not None:
        model = cls.from_pretrained(cfg.path, attn_implementation=cfg.attn_implementation, dtype=torch.float32, **moe)
        for key, value in fixed.items():
            if getattr(model.config, key, None) != value:
                raise ConfigError(
                    f"model.path: {cfg.path} has {key}={getattr(model.config, key, None)!r} but the "
                    f"processor's tokenizer says {value!r}; use the checkpoint's own processor"
                )
    else:
        try:
            config = transformers.AutoConfig.for_model(cfg.type, **{"use_cache": False, **cfg.config, **fixed})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"model.config: {exc}") from None
        config._attn_implementation = cfg.attn_implementation
        if moe:
            config._experts_implementation = cfg.experts_implementation
        torch.manual_seed(cfg.seed)  # every rank builds identical weights before FSDP shards them
        model = cls(config)
    # training: no KV cache (it would also disable packed-sequence masks); a VLM's text model reads its own config
    model.config.use_cache = False
    model.config.get_text_config().use_cache = False
    if cfg.freeze_vision:
        model.model.visual.requires_grad_(False)
    return model
