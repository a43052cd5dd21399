"""Tiny random-initialised models and batches for tests and demos (no downloads, fp32, seconds on a CPU)."""

from __future__ import annotations

import torch
import transformers

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
            use_cache=False)


# MoE extras: 8 experts, top-2, every layer sparse; eager experts (the numerical reference) unless overridden.
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.01)


def tiny_config(model_type: str, **overrides) -> transformers.PretrainedConfig:
    """A small config of `model_type`; training configs never use a KV cache (it also disables packing masks)."""
    extras = TINY_MOE if model_type.endswith("_moe") else {}
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **extras, **overrides})
    config._attn_implementation = "sdpa"
    if extras:
        config._experts_implementation = overrides.get("experts_implementation", "eager")
    return config


def random_packed_batch(lengths: tuple[int, ...], vocab_size: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """One row holding several sequences: position ids restart per sequence, no label crosses a boundary."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (1, sum(lengths)), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = input_ids.clone()
    labels[position_ids == 0] = -100  # a sequence's first token is nobody's target
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}
