"""Keep the language model's attention kwargs away from the vision tower.

A VLM's forward passes its ``**kwargs`` both to the vision tower (``get_image_features(..., **kwargs)``) and to the
language model. Packed-sequence flash-attention kwargs precomputed by the data pipeline for the LM
(``cu_seq_lens_q/k``, ``max_length_q/k``: the LM's token segments) would reach the ViT's attention, which passes its
own per-image ``cu_seq_lens`` by keyword: a duplicate-keyword error under flash attention, or silently wrong
segments in another kernel. The generated forward pops them before the vision calls and restores them for the LM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LM_ATTENTION_KWARGS", "split_lm_attention_kwargs"]

LM_ATTENTION_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def split_lm_attention_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(kwargs without the LM's attention kwargs, those kwargs); the input dict is left untouched."""
    rest = {k: v for k, v in kwargs.items() if k not in LM_ATTENTION_KWARGS}
    lm = {k: v for k, v in kwargs.items() if k in LM_ATTENTION_KWARGS}
    return rest, lm
