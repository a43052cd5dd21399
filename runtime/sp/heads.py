"""The Ulysses head rule, pure arithmetic: the parallel state checks a layout with it before any attention runs, and
the Ulysses, USP and ring attentions repeat KV heads by it (all import it from here, none from another). No torch
import: the parallel state's config checks stay light."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["kv_repeat_factor", "repeat_kv_heads"]


def repeat_kv_heads(x: Tensor, repeat: int) -> Tensor:
    """(b, kv, s, d) -> (b, kv * repeat, s, d), each head repeated in place (GQA grouping is preserved)."""
    return x if repeat == 1 else x.repeat_interleave(repeat, dim=1)


def kv_repeat_factor(num_heads: int, num_kv_heads: int, sp: int) -> int:
    """How often to repeat KV heads so every SP rank owns whole KV heads for its query heads."""
    if num_heads % sp:
        raise ValueError(f"{num_heads} attention heads cannot be split over sp={sp}: sp must divide the head count")
    if num_kv_heads % sp == 0:
        return 1
    if sp % num_kv_heads == 0:
        return sp // num_kv_heads
    raise ValueError(
        f"{num_kv_heads} key/value heads cannot be split over sp={sp}: sp must divide the KV head "
        f"count or be a multiple of it"
    )
