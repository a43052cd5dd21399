"""The Ulysses head rule, pure arithmetic: the parallel state checks a layout with it before any attention runs, and
the Ulysses attention repeats KV heads by it (both import it from here, neither from the other)."""

from __future__ import annotations

__all__ = ["kv_repeat_factor"]


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
