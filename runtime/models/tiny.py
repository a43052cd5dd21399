"""Tiny random-initialised models and batches for tests and demos (no downloads, fp32, seconds on a CPU)."""

from __future__ import annotations

import torch
import transformers

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
            use_cache=False)


def tiny_config(model_type: str, **overrides) -> transformers.PretrainedConfig:
    """A small config of `model_type`; training configs never use a KV cache (it also disables packing masks)."""
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **overrides})
    config._attn_implementation = "sdpa"
    return config


def random_packed_batch(lengths: tuple[int, ...], vocab_size: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """One row holding several sequences: position ids restart per sequence, no label crosses a boundary."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (1, sum(lengths)), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = input_ids.clone()
    labels[position_ids == 0] = -100  # a sequence's first token is nobody's target
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}
