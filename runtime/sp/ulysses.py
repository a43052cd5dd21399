"""Ulysses attention: all-to-all from sequence-sharded to head-sharded, full-sequence attention, and back.

The generated attention forward asks `ulysses_attn_implementation(name)` which implementation to use. With
SP off it returns `name` unchanged; with SP on it returns `ulysses_<name>`, registered in transformers'
AttentionInterface, which wraps the inner implementation (sdpa on CPU, flash-attn when installed). A model whose
implementation transformers does not register (``eager``: its module's own ``eager_attention_forward``, the only one
gpt_oss has on CPU since transformers refuses sdpa for it) passes that function as ``local`` (the
``sp/ulysses_attention`` template's ``local`` var), and Ulysses wraps it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from runtime.parallel.collectives import gather_heads_scatter_seq
from runtime.parallel.sites import mark_site
from runtime.parallel.state import get_parallel_state
from runtime.sp.head_kwargs import PER_HEAD_KWARGS, heads_of_rank
from runtime.sp.heads import kv_repeat_factor, repeat_kv_heads
from runtime.sp.overlap import seq_to_heads
from runtime.sp.usp import PREFIX as USP_PREFIX
from runtime.sp.usp import usp_attn_implementation

PREFIX = "ulysses_"

__all__ = ["PER_HEAD_KWARGS", "heads_of_rank", "ulysses_attention", "ulysses_attn_implementation"]


# Module attributes indexed by query head that an inner implementation reads from the module itself (gpt_oss's
# eager attention reads ``module.sinks``, not its ``s_aux`` keyword).
PER_HEAD_ATTRIBUTES = ("sinks",)


class _HeadShard:
    """The attention module as the inner implementation must see it: fewer heads, its own GQA ratio, and its
    per-head attributes (``PER_HEAD_ATTRIBUTES``) cut to this rank's heads (a slice: the gradient reaches the
    module's full parameter)."""

    def __init__(self, module: torch.nn.Module, num_key_value_groups: int, size: int = 1, rank: int = 0) -> None:
        self._module = module
        self.num_key_value_groups = num_key_value_groups
        self._size, self._rank = size, rank

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if name in PER_HEAD_ATTRIBUTES and isinstance(value, torch.Tensor) and self._size > 1:
            chunk = value.shape[0] // self._size
            return value[self._rank * chunk : (self._rank + 1) * chunk]
        return value


def ulysses_attention(inner: str | Callable[..., Any]):
    inner_name = inner if isinstance(inner, str) else "eager"

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
        shard = _HeadShard(module, num_heads // (num_kv_heads * repeat), sp, state.sp_rank)
        attend = ALL_ATTENTION_FUNCTIONS[inner] if isinstance(inner, str) else inner
        out, _ = attend(shard, query, key, value, attention_mask, **kwargs)
        # inner implementations return (b, s, h/sp, d) -> (b, s/sp, h, d)
        return gather_heads_scatter_seq(out, head_dim=2, seq_dim=1, group=group), None

    forward.__name__ = f"{PREFIX}{inner_name}"
    forward.local_attention = inner  # what a rank would run alone (the self-check plants it: self_check_power)
    return forward


def ulysses_attn_implementation(name: str, local: Callable[..., Any] | None = None) -> str:
    """The attention implementation to dispatch to: `name` itself unless SP is on; `usp_<name>` (Ulysses x ring,
    ``runtime.sp.usp``) when the layout has a ring. ``local``: the module's own function for a `name` transformers
    does not register (``eager``), wrapped as ``ulysses_<name>@<module>``."""
    state = get_parallel_state()
    if not state.sp_enabled:
        return name
    if name.startswith((PREFIX, USP_PREFIX)):
        return name
    registered = name in ALL_ATTENTION_FUNCTIONS
    if not registered and local is None:
        raise ValueError(
            f"Ulysses SP wraps a registered attention implementation (sdpa, flash_attention_2, ...) or the one the "
            f"model's spec names as its own (sp/ulysses_attention's `local` var); the model uses {name!r}, which is "
            f"neither: load it with an implementation its class supports (sdpa where transformers allows it)"
        )
    if state.ring_enabled:
        return usp_attn_implementation(name)
    wrapped = PREFIX + name if registered else f"{PREFIX}{name}@{local.__module__}"
    if wrapped not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(wrapped, ulysses_attention(name if registered else local))
    return wrapped
