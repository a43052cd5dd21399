"""The trainer's config checks across sections (a model type with a generated class, the keys its family reads,
the attention implementation installed here, ``model.config`` keys its config class knows, outputs), run by
``runtime.train.config.parse_config`` after every section was built."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from runtime.config.common import REPORT_TO
from runtime.config.errors import ConfigError, ConfigErrors
from runtime.config.sections import check_choice
from runtime.train.model_keys import model_config_problems, model_type_problem
from runtime.train.tracking.requirements import missing_backend

if TYPE_CHECKING:
    from runtime.train.config_sections import RunConfig

__all__ = ["ATTN_IMPLEMENTATIONS", "CHECKS", "DIFFUSERS_ATTENTION_BACKENDS", "EXPERTS_IMPLEMENTATIONS"]

# Attention implementations a training forward can use (transformers' AttentionInterface on 5.14.1 plus eager; the
# runtime's own `ulysses_<name>` wrappers are chosen by the runtime under SP, never named in a config), and the
# module each flash-attention implementation imports (absent on CPU machines).
ATTN_IMPLEMENTATIONS = (
    "sdpa",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)
_ATTN_MODULES = {
    "flash_attention_2": "flash_attn",
    "flash_attention_3": "flash_attn_interface",
    "flash_attention_4": "flash_attn",
}
# diffusers 0.40.0's AttentionBackendName values (a DiT's `attention_backend`), listed here so that a config is
# checked without importing diffusers (and torch); tests/hostile/test_train_config.py compares them with the enum.
DIFFUSERS_ATTENTION_BACKENDS = (
    "flash",
    "flash_hub",
    "flash_varlen",
    "flash_varlen_hub",
    "flash_4_hub",
    "_flash_3",
    "_flash_varlen_3",
    "_flash_3_hub",
    "_flash_3_varlen_hub",
    "aiter_fa2_hub",
    "flex",
    "native",
    "_native_cudnn",
    "_native_efficient",
    "_native_flash",
    "_native_math",
    "_native_npu",
    "_native_xla",
    "sage",
    "sage_hub",
    "sage_varlen",
    "_sage_qk_int8_pv_fp8_cuda",
    "_sage_qk_int8_pv_fp8_cuda_sm90",
    "_sage_qk_int8_pv_fp16_cuda",
    "_sage_qk_int8_pv_fp16_triton",
    "xformers",
)
EXPERTS_IMPLEMENTATIONS = ("eager", "patchgen_grouped", "patchgen_triton", "patchgen_eager")  # runtime/moe/dispatch.py


def _check_betas(config: RunConfig) -> None:
    betas = config.optim.betas
    if len(betas) != 2 or not all(
        isinstance(b, int | float) and not isinstance(b, bool) and 0 <= b < 1 for b in betas
    ):
        raise ConfigError(f"optim.betas: expected two numbers in [0, 1), found {betas!r}")


def _check_outputs(config: RunConfig) -> None:
    errors = ConfigErrors()
    if config.checkpoint.interval and not config.checkpoint.dir:
        errors.add("checkpoint.interval: set checkpoint.dir to say where checkpoints go")
    for index, name in enumerate(config.log.report_to):
        errors.run(lambda index=index, name=name: check_choice(name, f"log.report_to[{index}]", REPORT_TO))
        missing = missing_backend(name)  # find_spec only: no tracker (nor torch) imported
        if missing:
            errors.add(f"log.report_to[{index}]: {missing}")
    if config.export.fuse_lora and config.lora.rank is None:
        errors.add("export.fuse_lora: only for LoRA runs (set lora.rank)")
    errors.raise_if_any()


def _registry_entry(config: RunConfig) -> Any:
    from runtime.models.registry import REGISTRY

    return REGISTRY.get(config.model.type) if isinstance(config.model.type, str) else None


def _check_model_type(config: RunConfig) -> None:
    """A model type with a generated class (``runtime/models/registry.py``: generated ``*.model.json`` records)."""
    problem = model_type_problem(config.model.type)
    if problem:
        raise ConfigError(problem)


def _check_family_keys(config: RunConfig) -> None:
    """Keys that only DiTs read, or that DiTs do not read."""
    entry = _registry_entry(config)
    if entry is None:
        return
    if entry.family == "dit":
        _check_dit(config)
    else:
        _check_not_dit(config)


def _check_model_kind(config: RunConfig) -> None:
    """Text models read a tokenizer, vision-language models a processor; freeze_vision needs a vision tower."""
    entry = _registry_entry(config)
    if entry is None or entry.family == "dit":
        return  # _check_model_type names the known types; DiTs: _check_dit
    if entry.is_vlm:
        if config.data.processor is None:
            raise ConfigError(
                f"data.processor: required for the vision-language model {config.model.type!r} (a local "
                f"processor directory: tokenizer with vision tokens + image/video processors)"
            )
        if config.data.tokenizer is not None:
            raise ConfigError(
                "data.tokenizer: a vision-language model reads its tokenizer from data.processor; "
                "remove data.tokenizer"
            )
    else:
        if config.data.tokenizer is None:
            raise ConfigError("data.tokenizer: required key missing")
        if config.data.processor is not None:
            raise ConfigError(
                f"data.processor: only vision-language models take a processor; {config.model.type!r} "
                f"is a text model (use data.tokenizer)"
            )
        if config.model.freeze_vision:
            raise ConfigError(f"model.freeze_vision: {config.model.type!r} has no vision tower")
        if config.data.media_dir is not None:
            raise ConfigError(f"data.media_dir: {config.model.type!r} is a text model; its data has no media files")
    if config.model.freeze_audio and not entry.has("audio"):
        raise ConfigError(f"model.freeze_audio: {config.model.type!r} has no audio encoder")


def _check_attention(config: RunConfig) -> None:
    """A known attention implementation, and for flash attention its package (a CPU machine has none): transformers
    would say so only when the model is built, in a multi-line error."""
    entry = _registry_entry(config)
    name = config.model.attn_implementation
    if entry is not None and entry.family == "dit":
        # diffusers' attention backends (`attention_backend=`); sdpa keeps the processors' own attention
        check_choice(name, "model.attn_implementation", ("sdpa", *DIFFUSERS_ATTENTION_BACKENDS))
        return
    check_choice(name, "model.attn_implementation", ATTN_IMPLEMENTATIONS)
    module = _ATTN_MODULES.get(name)
    if module and importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"model.attn_implementation: {name} needs the {module} package, which is not installed here "
            f"(the gpu extra, CUDA machines only); use sdpa"
        )


def _check_model_config(config: RunConfig) -> None:
    """``model.config`` sets a random init's config: every key must be one its config class knows (read from
    transformers' source, without importing it: ``runtime/train/config_source.py``), and every size in it lies
    within ``runtime/train/model_limits.py``'s bounds."""
    model = config.model
    if model.path is not None and model.config:
        raise ConfigError(
            "model.config: sets the config of a random init, but model.path is set (its config.json is used); "
            "remove model.config or model.path"
        )
    entry = _registry_entry(config)
    if not model.config or entry is None or entry.family == "dit":
        return  # an unknown type: _check_model_type names the known ones; DiTs: _check_dit
    errors = ConfigErrors()
    errors.add(*model_config_problems(model.type, entry.module, model.config))
    errors.raise_if_any()


def _check_dit(config: RunConfig) -> None:
    """A DiT reads a pipeline directory and bucketed media; the tokenizer/processor keys belong to other models."""
    kind = config.model.type
    for key in ("tokenizer", "processor"):
        if getattr(config.data, key) is not None:
            raise ConfigError(
                f"data.{key}: the DiT {kind!r} reads its text encoders from model.path (a diffusers pipeline "
                f"directory); remove data.{key}"
            )
    if config.model.path is None:
        raise ConfigError(
            f"model.path: required for the DiT {kind!r}: a diffusers pipeline directory (model_index.json, "
            f"transformer/, VAE, text encoders, scheduler)"
        )
    if config.model.config:
        raise ConfigError(
            f"model.config: the DiT {kind!r} starts from the transformer in model.path (its transformer/config.json); "
            f"remove model.config"
        )
    for tower in ("vision", "audio"):
        if getattr(config.model, f"freeze_{tower}"):
            raise ConfigError(f"model.freeze_{tower}: {kind!r} has no {tower} tower (its condition model is frozen)")
    if config.data.buckets is None:
        raise ConfigError(
            "data.buckets: required for DiTs: [[frames, height, width], ...] (video models) or [[height, width], ...]"
        )
    from runtime.data.dit.buckets import check_bucket_limits

    try:
        check_bucket_limits(config.data.buckets)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    prompts = config.validation.prompts  # runtime/train/samples.py generates each one
    if prompts is not None and (not prompts or not all(isinstance(p, str) and p.strip() for p in prompts)):
        raise ConfigError(f"validation.prompts: expected a list of non-empty prompts (or null), found {prompts!r:.80}")
    if config.parallel.ep != 1:
        raise ConfigError(f"parallel.ep: the DiT {kind!r} has no experts; remove parallel.ep")
    ema = config.dit.ema_decay
    if ema is not None and not 0.0 < ema < 1.0:
        raise ConfigError(f"dit.ema_decay: expected a number in (0, 1) (e.g. 0.999), found {ema}")
    if config.eval != type(config.eval)():  # runtime/train/evaluate.py: text, VLM and omni models only
        raise ConfigError(
            f"eval: an eval-loss set is for text, VLM and omni models; for the DiT {kind!r} use validation "
            f"(sample images/videos from the current weights)"
        )


def _check_not_dit(config: RunConfig) -> None:
    """Keys that only DiTs read are errors elsewhere (a silently ignored key is a run that is not what was asked)."""
    kind = config.model.type
    for key, default in (("buckets", None), ("batch_size", 1), ("frame_stride", 1), ("cache", None)):
        if getattr(config.data, key) != default:
            raise ConfigError(f"data.{key}: only diffusion transformers read it; {kind!r} is not one")
    if config.dit != type(config.dit)():
        raise ConfigError(f"dit: only diffusion transformers read this section; {kind!r} is not one")
    if config.validation != type(config.validation)():
        raise ConfigError(
            f"validation: sample generation is for diffusion transformers; {kind!r} is not one (an eval loss: eval)"
        )
    for key in ("every_steps", "max_batches"):  # without a file they would be silently ignored
        if config.eval.path is None and getattr(config.eval, key) != getattr(type(config.eval)(), key):
            raise ConfigError(f"eval.{key}: set eval.path (the held-out file) or remove eval.{key}")


# in this order: a later check may rely on what an earlier one established (a known model type)
CHECKS = (
    _check_betas,
    _check_model_type,
    _check_attention,
    _check_family_keys,
    _check_model_kind,
    _check_model_config,
    _check_outputs,
)
