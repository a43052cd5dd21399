"""BAGEL's checkpoint format and special tokens.

Checkpoints: ``BAGEL_KEY_MAP`` maps BAGEL's ``ema.safetensors`` names to ours by prefix (ours drop the
``language_model.model.`` prefix); keys under ``BAGEL_IGNORED_PREFIXES`` (the ViT understanding tower, which this
denoiser does not have) are skipped. ``load_bagel_checkpoint`` / ``save_bagel_checkpoint`` round-trip.

Tokens: BAGEL's tokenizer gains four special tokens (``BAGEL_SPECIAL_TOKENS``); ``bagel_new_token_ids`` reads their
ids and ``bagel_prompt_ids`` lays a prompt out as BAGEL's ``prepare_prompts`` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = [
    "BAGEL_KEY_MAP",
    "BAGEL_IGNORED_PREFIXES",
    "BAGEL_SPECIAL_TOKENS",
    "BAGEL_WEIGHTS_NAME",
    "bagel_new_token_ids",
    "bagel_prompt_ids",
    "from_bagel_keys",
    "to_bagel_keys",
    "load_bagel_checkpoint",
    "save_bagel_checkpoint",
]

BAGEL_WEIGHTS_NAME = "ema.safetensors"
# BAGEL's tokenizer gains these four special tokens (its ``add_special_tokens``); ``new_token_ids`` names them.
BAGEL_SPECIAL_TOKENS = {
    "bos_token_id": "<|im_start|>",
    "eos_token_id": "<|im_end|>",
    "start_of_image": "<|vision_start|>",
    "end_of_image": "<|vision_end|>",
}


def bagel_new_token_ids(tokenizer: Any) -> dict[str, int]:
    """BAGEL's ``new_token_ids`` of ``tokenizer``: the ids of its four special tokens (``KeyError`` naming a missing
    one)."""
    ids = {}
    for key, token in BAGEL_SPECIAL_TOKENS.items():
        value = tokenizer.convert_tokens_to_ids(token)
        if value is None or value == tokenizer.unk_token_id:
            raise KeyError(f"the tokenizer has no {token} token (BAGEL's {key})")
        ids[key] = int(value)
    return ids


def bagel_prompt_ids(tokenizer: Any, prompt: str, new_token_ids: Mapping[str, int]) -> list[int]:
    """A prompt's token ids as BAGEL's ``prepare_prompts`` makes them: ``[bos] + tokenizer.encode(prompt) + [eos]``."""
    return [new_token_ids["bos_token_id"], *tokenizer.encode(prompt), new_token_ids["eos_token_id"]]


# (checkpoint prefix, our prefix); the first matching checkpoint prefix wins, so longer prefixes come first.
BAGEL_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("language_model.model.embed_tokens.", "embed_tokens."),
    ("language_model.model.layers.", "layers."),
    ("language_model.model.norm_moe_gen.", "norm_moe_gen."),
    ("language_model.model.norm.", "norm."),
    ("language_model.lm_head.", "lm_head."),
    ("time_embedder.", "time_embedder."),
    ("vae2llm.", "vae2llm."),
    ("llm2vae.", "llm2vae."),
    ("latent_pos_embed.", "latent_pos_embed."),
)
BAGEL_IGNORED_PREFIXES: tuple[str, ...] = ("vit_model.", "connector.", "vit_pos_embed.")


def _swap_prefix(key: str, table: Sequence[tuple[str, str]]) -> str | None:
    for src, dst in table:
        if key.startswith(src):
            return dst + key[len(src) :]
    return None


def from_bagel_keys(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """BAGEL checkpoint names -> ours; returns ``(mapped, unmapped keys)`` (ignored prefixes are neither)."""
    out, unmapped = {}, []
    for key, value in state.items():
        if key.startswith(BAGEL_IGNORED_PREFIXES):
            continue
        new = _swap_prefix(key, BAGEL_KEY_MAP)
        if new is None:
            unmapped.append(key)
        else:
            out[new] = value
    return out, unmapped


def to_bagel_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names -> BAGEL checkpoint names (the inverse of ``from_bagel_keys``); raises on an unmappable key."""
    inverse = tuple(sorted(((d, s) for s, d in BAGEL_KEY_MAP), key=lambda kv: -len(kv[0])))
    out = {}
    for key, value in state.items():
        new = _swap_prefix(key, inverse)
        if new is None:
            raise KeyError(f"no BAGEL checkpoint name for {key!r}")
        out[new] = value
    return out


def save_bagel_checkpoint(model: torch.nn.Module, path: str, merge_adapters: bool = False) -> None:
    """The base weights (LoRA merged or left out) under BAGEL's names, as one safetensors file."""
    save_file(to_bagel_keys(model.base_state_dict(merge_adapters)), path, metadata={"format": "pt"})


def load_bagel_checkpoint(model: torch.nn.Module, path: str, strict: bool = True) -> tuple[list[str], list[str]]:
    """Load an ``ema.safetensors``-style file into ``model`` (before adding adapters); returns ``(missing,
    unexpected)`` in our names / the checkpoint's names; ``strict`` raises when either is non-empty."""
    mapped, unexpected = from_bagel_keys(load_file(path))
    result = model.load_state_dict(mapped, strict=False)
    missing = list(result.missing_keys)
    unexpected = unexpected + list(result.unexpected_keys)
    if strict and (missing or unexpected):
        raise KeyError(f"checkpoint {path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return missing, unexpected
