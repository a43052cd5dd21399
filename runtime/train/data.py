"""The trainer's data side: what reads the text (a tokenizer, or a VLM's processor), which model-config values the
data dictates, and the packed, DP-sharded, resumable loader."""

from __future__ import annotations

from typing import Any

import torch

from runtime.config.errors import ConfigError
from runtime.data.loader import PackedLoader
from runtime.data.sampler import Order
from runtime.data.samples import LocatedSample
from runtime.data.text.packing import TextPackedLoader
from runtime.data.text.tokenization import load_tokenizer, tokenize_samples
from runtime.models.registry import lookup
from runtime.parallel.state import ParallelState
from runtime.train.config import RunConfig


def is_vlm(config: RunConfig) -> bool:
    try:
        return lookup(config.model.type).is_vlm
    except ValueError as exc:
        raise ConfigError(f"model.type: {exc}") from None


def is_omni(config: RunConfig) -> bool:
    """An omni model (audio too): its own processor, data pipeline and packing (runtime/data/audio/)."""
    return lookup(config.model.type).family == "omni"


def is_dit(config: RunConfig) -> bool:
    """A diffusion transformer (``family = "dit"``): trained by ``runtime/train/dit.py``."""
    try:
        return lookup(config.model.type).family == "dit"
    except ValueError as exc:
        raise ConfigError(f"model.type: {exc}") from None


def load_text_processor(config: RunConfig) -> Any:
    """The tokenizer (text models) or the processor (VLMs, omni models) from its local directory."""
    try:
        if is_vlm(config) and is_omni(config):
            from runtime.data.audio.processor import load_omni_processor

            return load_omni_processor(config.data.processor, config.model.type)
        if is_vlm(config):
            from runtime.data.vision.processor import load_processor

            return load_processor(config.data.processor)
        return load_tokenizer(config.data.tokenizer)
    except (OSError, ValueError) as exc:
        key = "data.processor" if is_vlm(config) else "data.tokenizer"
        raise ConfigError(f"{key}: {exc}") from None


def fixed_model_config(config: RunConfig, processor: Any) -> dict[str, Any]:
    """A VLM's special-token ids come from its processor's tokenizer, not from the model config's defaults."""
    if not is_vlm(config):
        return {}
    if is_omni(config):
        from runtime.data.audio.processor import omni_token_ids

        return omni_token_ids(processor)
    from runtime.data.vision.processor import vlm_token_ids

    return vlm_token_ids(processor)


def check_vocab(model: torch.nn.Module, processor: Any) -> None:
    tokenizer = getattr(processor, "tokenizer", processor)
    vocab = model.config.get_text_config().vocab_size
    if len(tokenizer) > vocab:
        raise ConfigError(
            f"model.config: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{vocab}; raise vocab_size (text_config.vocab_size for a VLM) to at least {len(tokenizer)}"
        )


def build_loader(
    config: RunConfig,
    state: ParallelState,
    model: torch.nn.Module,
    processor: Any,
    samples: list[LocatedSample],
    shuffle: bool = True,
) -> PackedLoader:
    """Packed rows for this rank's DP position: ``TextPackedLoader``, ``MultimodalPackedLoader`` (VLM) or
    ``OmniPackedLoader``, from the samples ``check_data`` read (``shuffle=False``: in file order, as the eval set). A
    sample that fails to tokenize (e.g. an image that does not decode) or a data set with nothing usable is a
    ``ConfigError`` naming the file (and line)."""
    budget = config.data.token_budget
    order = Order.for_parallel_state(state, config.data.seed, shuffle)
    try:
        if not is_vlm(config):
            tokenized = tokenize_samples([s.sample for s in samples], processor)
            return TextPackedLoader(tokenized, budget, order)
        if is_omni(config):
            from runtime.data.audio.packing import OmniPackedLoader
            from runtime.data.audio.tokenization import tokenize_omni

            fn = type(model).get_position_id_func(model.config)
            omni = [_tokenize_one(tokenize_omni, s, processor, fn, model.config) for s in samples]
            return OmniPackedLoader(omni, budget, order)
        from runtime.data.vision.packing import MultimodalPackedLoader
        from runtime.data.vision.tokenization import tokenize_multimodal

        position_ids = type(model).get_position_id_func(model.config)
        tokenized = [_tokenize_one(tokenize_multimodal, s, processor, position_ids) for s in samples]
        return MultimodalPackedLoader(tokenized, budget, order)
    except ValueError as exc:  # nothing usable within the budget
        raise ConfigError(f"data.path: {config.data.path}: {exc} (data.token_budget is {budget})") from None


def _tokenize_one(tokenize, located: LocatedSample, *args: Any) -> Any:
    try:
        return tokenize(located.sample, *args)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data.path: {located.where}: {exc}") from None


def check_sp(model: torch.nn.Module, config: RunConfig, sp: int) -> None:
    """Ulysses SP splits the LM's heads (its Ulysses degree ``sp / parallel.ring`` only: the ring splits the
    sequence), and a VLM's ViT heads too (the ViT runs Ulysses over the whole SP group, ring or not)."""
    from runtime.sp.heads import check_sp_compatible

    text = model.config.get_text_config()
    ring = config.parallel.ring or 1
    try:
        check_sp_compatible(text.num_attention_heads, text.num_key_value_heads, config.data.token_budget, sp, ring)
        vision = getattr(model.config, "vision_config", None)
        if vision is not None and vision.num_heads % sp:
            raise ValueError(f"the vision tower's {vision.num_heads} heads are not divisible by sp={sp}")
        audio = getattr(model.config, "audio_config", None)
        if audio is not None and audio.encoder_attention_heads % sp:
            raise ValueError(f"the audio encoder's {audio.encoder_attention_heads} heads are not divisible by sp={sp}")
    except ValueError as exc:
        raise ConfigError(f"parallel.sp: {exc}") from None
