"""ViT segment lengths on the host, computed once per vision forward instead of once per attention layer.

Upstream ViT attention derives what it needs from the device tensor ``cu_seqlens`` in every block: the flash path a
``max_seqlen`` (a device scalar the kernel wrapper turns into a Python int) and the other kernels the split sizes
(``lengths.tolist()``). Each is a host sync per block, twice per block with activation checkpointing. The generated
vision model reads ``cu_seqlens`` on the host once (``with_host_seqlens``, after SP padding) and attaches the Python
values to the tensor; the attention reads them back. A ``cu_seqlens`` without them (a caller that built its own)
takes upstream's path, so the numbers are identical either way.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["with_host_seqlens", "vision_max_seqlen", "vision_segment_lengths"]

_ATTR = "_patchgen_host_lengths"


def with_host_seqlens(cu_seqlens: Tensor) -> Tensor:
    """``cu_seqlens`` with its segment lengths attached as a CPU tensor (one device->host copy)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to("cpu")
    setattr(cu_seqlens, _ATTR, lengths)
    return cu_seqlens


def vision_segment_lengths(cu_seqlens: Tensor) -> Tensor:
    """Segment lengths: the attached CPU copy (``.tolist()`` is then free) or, without one, upstream's device diff."""
    host = getattr(cu_seqlens, _ATTR, None)
    return host if host is not None else cu_seqlens[1:] - cu_seqlens[:-1]


def vision_max_seqlen(cu_seqlens: Tensor) -> int | Tensor:
    """Longest segment: a Python int from the attached lengths, or upstream's device scalar without them."""
    host = getattr(cu_seqlens, _ATTR, None)
    if host is None:
        return (cu_seqlens[1:] - cu_seqlens[:-1]).max()
    return int(host.max()) if host.numel() else 0
