"""The Ulysses head rule, pure arithmetic: a layout is checked with it before any attention runs
(``check_sp_compatible``), and the Ulysses, USP and ring attentions repeat KV heads by it (all import it from here,
none from another). No torch import: the config checks stay light."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["check_sp_compatible", "kv_repeat_factor", "repeat_kv_heads"]


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


def check_sp_compatible(
    num_heads: int, num_kv_heads: int, seq_len: int | None, sp_size: int, ring_size: int = 1
) -> int:
    """Raise a one-line ``ValueError`` if SP of ``sp_size`` (Ulysses ``sp_size // ring_size`` x ring ``ring_size``)
    cannot run this attention / sequence.

    The head rule is ``kv_repeat_factor`` (its only implementation), applied to the Ulysses degree
    only (the ring dim splits the sequence, never the heads): it must divide the query head count, and divide the KV
    head count or be a multiple of it. ``seq_len`` (the row length before SP padding; None to skip the check) must be
    at least ``sp`` so every rank holds a token. Returns the KV repeat factor.
    """
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size must be a positive integer, got {sp_size!r}")
    if isinstance(ring_size, bool) or not isinstance(ring_size, int) or ring_size < 1 or sp_size % ring_size:
        raise ValueError(f"ring_size={ring_size!r} must be a positive integer dividing sp_size={sp_size}")
    try:
        repeat = kv_repeat_factor(num_heads, num_kv_heads, sp_size // ring_size)
    except ValueError as exc:
        if ring_size == 1:
            raise
        hint = f"with ring={ring_size} the Ulysses degree is sp / ring = {sp_size // ring_size}; raise the ring"
        raise ValueError(f"{exc} ({hint})") from None
    if seq_len is not None and seq_len < sp_size:
        raise ValueError(
            f"a sequence of {seq_len} tokens cannot be split over sp={sp_size}: sp must not exceed the sequence length"
        )
    return repeat
