"""Ulysses attention: all-to-all from sequence-sharded to head-sharded, full-sequence attention, and back.

The generated attention forward asks `ulysses_attn_implementation(name)` which implementation to use. With
SP off it returns `name` unchanged; with SP on it returns `ulysses_<name>`, registered in transformers'
AttentionInterface, which wraps the inner implementation (sdpa on CPU, flash-attn when installed).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from runtime.parallel.collectives import gather_heads_scatter_seq
from runtime.parallel.sites import mark_site
from runtime.parallel.state import get_parallel_state
from runtime.sp.heads import kv_repeat_factor, repeat_kv_heads
from runtime.sp.overlap import seq_to_heads
from runtime.sp.usp import PREFIX as USP_PREFIX
from runtime.sp.usp import usp_attn_implementation

PREFIX = "ulysses_"


# Keyword arguments indexed by query head (attention sinks: a learned per-head logit in the softmax denominator).
PER_HEAD_KWARGS = ("s_aux",)


def heads_of_rank(kwargs: dict[str, Any], num_heads: int, size: int, rank: int) -> dict[str, Any]:
    """``kwargs`` with every per-head tensor (``PER_HEAD_KWARGS``) cut to the heads this rank attends with after the
    all-to-all (the ``rank``-th of ``size`` contiguous head chunks): the inner implementation sees this rank's heads,
    so a full per-head tensor would be applied to the wrong heads (or fail on its length)."""
    out = dict(kwargs)
    for name in PER_HEAD_KWARGS:
        value = out.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and size > 1:
            if value.shape[0] != num_heads:
                raise ValueError(f"{name}: expected one entry per query head ({num_heads}), got {tuple(value.shape)}")
            chunk = num_heads // size
            out[name] = value[rank * chunk : (rank + 1) * chunk]
    return out


class _HeadShard:
    """The attention module as the inner implementation must see it: fewer heads, its own GQA ratio."""

    def __init__(self, module: torch.nn.Module, num_key_value_groups: int) -> None:
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def ulysses_attention(inner: str):
    def forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        mark_site(module)
        state = get_parallel_state()
        group, sp = state.sp_group, state.sp_size
        num_heads, num_kv_heads = query.shape[1], key.shape[1]
        kwargs = heads_of_rank(kwargs, num_heads, sp, state.sp_rank)
        repeat = kv_repeat_factor(num_heads, num_kv_heads, sp)
        key, value = repeat_kv_heads(key, repeat), repeat_kv_heads(value, repeat)
        # (b, h, s/sp, d) -> (b, h/sp, s, d)
        query, key, value = seq_to_heads((query, key, value), seq_dim=2, head_dim=1, group=group)
        shard = _HeadShard(module, num_heads // (num_kv_heads * repeat))
        out, _ = ALL_ATTENTION_FUNCTIONS[inner](shard, query, key, value, attention_mask, **kwargs)
        # inner implementations return (b, s, h/sp, d) -> (b, s/sp, h, d)
        return gather_heads_scatter_seq(out, head_dim=2, seq_dim=1, group=group), None

    forward.__name__ = f"{PREFIX}{inner}"
    return forward


def ulysses_attn_implementation(name: str) -> str:
    """The attention implementation to dispatch to: `name` itself unless SP is on; `usp_<name>` (Ulysses x ring,
    ``runtime.sp.usp``) when the layout has a ring."""
    state = get_parallel_state()
    if not state.sp_enabled:
        return name
    if name.startswith((PREFIX, USP_PREFIX)):
        return name
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"Ulysses SP wraps a registered attention implementation (sdpa, flash_attention_2, ...); "
            f"the model uses {name!r}. Load it with attn_implementation='sdpa'."
        )
    if state.ring_enabled:
        return usp_attn_implementation(name)
    wrapped = PREFIX + name
    if wrapped not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(wrapped, ulysses_attention(name))
    return wrapped
