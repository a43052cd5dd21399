"""RoPE tables in either form ``sp/rope_slice`` states: a (cos, sin) pair, or one tensor (complex frequencies:
transformers' Llama 4 rotary embedding returns ``freqs_cis``, complex64 of shape (batch, seq, head_dim / 2)). Each
SP rank keeps its own positions of the table computed from the global position ids, under Ulysses and under a ring
(zigzag chunks); a form the patch misstates is refused in one line instead of slicing the batch rows."""

from __future__ import annotations

import pytest
import torch
import transformers

from runtime.sp.positions import slice_position_embeddings
from tests.dist_utils import run_distributed

LENGTH = 12


def _llama4_freqs() -> torch.Tensor:
    """Upstream's own one-tensor RoPE table for global positions 0 .. LENGTH - 1."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding

    config = transformers.Llama4TextConfig(
        hidden_size=32, num_attention_heads=2, head_dim=16, num_hidden_layers=1, intermediate_size=32,
        intermediate_size_mlp=32, vocab_size=50,
    )  # fmt: skip
    hidden = torch.zeros(2, LENGTH, 32)
    return Llama4TextRotaryEmbedding(config)(hidden, torch.arange(LENGTH)[None].expand(2, -1))


def slice_worker(rank: int, world_size: int, ring: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(this rank's one-tensor slice, its (cos, sin) slice's cos, the positions that rank owns)."""
    from runtime.parallel.state import init_parallel_state, set_parallel_state
    from runtime.sp.layout import rank_token_index

    state = init_parallel_state(sp_size=world_size, ring_size=ring)
    try:
        freqs = _llama4_freqs()
        pair = (freqs.real.contiguous(), freqs.imag.contiguous())
        one = slice_position_embeddings(freqs, form="tensor")
        cos, _ = slice_position_embeddings(pair)
        index = rank_token_index(LENGTH, state.sp_size, state.ring_size, state.sp_rank) if ring > 1 else None
        half = LENGTH // world_size
        owned = tuple(index.tolist()) if index is not None else tuple(range(rank * half, (rank + 1) * half))
        return one, cos, owned
    finally:
        set_parallel_state(None)


@pytest.mark.dist
@pytest.mark.parametrize("ring", [1, 2])
def test_each_rank_keeps_its_positions_of_either_form(ring: int) -> None:
    freqs = _llama4_freqs()
    assert freqs.is_complex() and freqs.shape == (2, LENGTH, 8)  # head_dim 16: 8 complex frequencies
    for one, cos, owned in run_distributed(slice_worker, 2, ring, timeout=120):
        assert torch.equal(one, freqs[:, list(owned)]) and torch.equal(cos, freqs.real[:, list(owned)])


def test_a_misstated_form_is_refused_in_one_line() -> None:
    freqs = _llama4_freqs()
    with pytest.raises(ValueError, match=r"one tensor of shape \(2, 12, 8\), but the patch states form = 'pair'"):
        slice_position_embeddings(freqs)
    with pytest.raises(ValueError, match=r"a tuple, but the patch states form = 'tensor'; state form = 'pair'"):
        slice_position_embeddings((freqs.real, freqs.imag), form="tensor")
    assert slice_position_embeddings(freqs, form="tensor") is freqs  # SP off: upstream's table itself
