"""Build the generated model a run trains: from a local HF checkpoint or randomly initialised from a config."""

from __future__ import annotations

from typing import Any

import torch
import transformers

from runtime.config.errors import ConfigError
from runtime.models.registry import lookup
from runtime.models.submodel_checkpoint import drop_parts_left_out
from runtime.moe.dispatch import check_expert_layouts, register_experts_kernels
from runtime.parallel.state import get_parallel_state
from runtime.train.config import ModelConfig


def _key_name(entry: Any) -> str:
    """A loading-info entry: a key, or (key, checkpoint shape, model shape) for a mismatch."""
    if isinstance(entry, tuple | list) and len(entry) == 3:
        return f"{entry[0]} {tuple(entry[1])} vs {tuple(entry[2])}"
    return str(entry)


def _listed(entries: Any, limit: int = 4) -> str:
    names = sorted(_key_name(e) for e in entries)
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def load_pretrained(cls: type, path: str, **kwargs: Any) -> torch.nn.Module:
    """``cls.from_pretrained(path)`` in fp32, where weights that do not match the model are an error, not a warning:
    missing keys would train from random values, unexpected ones are weights silently dropped, mismatched shapes
    are re-initialised. One line naming the keys replaces transformers' multi-line load report."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the load report is a warning; the error below says it in one line
    bars = transformers.utils.logging.is_progress_bar_enabled()
    if get_parallel_state().rank != 0:  # one "Loading weights" bar per run, not one per rank
        transformers.utils.logging.disable_progress_bar()
    try:
        model, info = cls.from_pretrained(
            path, dtype=torch.float32, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
        )
    except (OSError, ValueError, RuntimeError) as exc:  # no config/weights there, or weights it cannot convert
        first = " ".join(str(exc).split())[:300]
        raise ConfigError(f"model.path: cannot load {path} as {cls.__name__}: {first}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()
    # a sub-model's checkpoint may be its full model's: the parts the class declares as left out are dropped, counted
    info["unexpected_keys"] = drop_parts_left_out(cls, (_key_name(k) for k in info.get("unexpected_keys") or ()))
    problems = [
        f"{what} {_listed(info.get(key))}"
        for key, what in (
            ("missing_keys", "missing keys"),
            ("unexpected_keys", "unexpected keys"),
            ("mismatched_keys", "mismatched shapes (checkpoint vs model)"),
            ("error_msgs", "errors"),
        )
        if info.get(key)
    ]
    if problems:
        raise ConfigError(
            f"model.path: {path} does not match {cls.__name__}: {'; '.join(problems)}; use a checkpoint of this "
            f"model type and size"
        )
    return model


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
        model = load_pretrained(cls, cfg.path, attn_implementation=cfg.attn_implementation, **moe)
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
    try:
        check_expert_layouts(model)
    except ValueError as exc:
        raise ConfigError(f"model.experts_implementation: {exc}") from None
    # training: no KV cache (it would also disable packed-sequence masks); a VLM's text model reads its own config
    model.config.use_cache = False
    model.config.get_text_config().use_cache = False
    for tower, frozen in (("vision", cfg.freeze_vision), ("audio", cfg.freeze_audio)):
        if frozen:
            model.get_submodule(tower_path(entry, tower)).requires_grad_(False)
    return model


def tower_path(entry, tower: str) -> str:
    """Where a model keeps a tower (``vision``, ``audio``): its spec's ``[model.data] towers``, else the Qwen-VL
    layout (``model.visual``)."""
    towers = entry.data.get("towers", {"vision": "model.visual"})
    if tower not in towers:
        raise ConfigError(f"model.freeze_{tower}: {entry.model_type!r} names no {tower} tower ([model.data] towers)")
    return towers[tower]
