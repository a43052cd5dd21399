"""Build the generated model a run trains: from a local HF checkpoint or randomly initialised from a config."""

from __future__ import annotations

import torch
import transformers

from runtime.models.registry import lookup
from runtime.moe.dispatch import register_experts_kernels
from runtime.train.config import ConfigError, ModelConfig


def build_model(cfg: ModelConfig) -> torch.nn.Module:
    register_experts_kernels()
    try:
        cls = lookup(cfg.type).causal_lm_class()
    except ValueError as exc:
        raise ConfigError(f"model.type: {exc}") from None
    moe = {"experts_implementation": cfg.experts_implementation} if hasattr(cls, "_ep_plan") else {}
    if cfg.path is not None:
        model = cls.from_pretrained(cfg.path, attn_implementation=cfg.attn_implementation, dtype=torch.float32,
                                    **moe)
    else:
        try:
            config = transformers.AutoConfig.for_model(cfg.type, **{"use_cache": False, **cfg.config})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"model.config: {exc}") from None
        config._attn_implementation = cfg.attn_implementation
        if moe:
            config._experts_implementation = cfg.experts_implementation
        torch.manual_seed(cfg.seed)  # every rank builds identical weights before FSDP shards them
        model = cls(config)
    model.config.use_cache = False  # training: no KV cache (it would also disable packed-sequence masks)
    return model
