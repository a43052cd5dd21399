"""The LM's flash-attention varlen kwargs computed by the collator from a packed row's position ids."""

from __future__ import annotations

import pytest
import torch

from runtime.data.sp_batch import packed_attention_kwargs, pad_to_multiple


def test_segments_of_a_padded_text_row() -> None:
    row = {
        "input_ids": torch.ones(1, 9, dtype=torch.long),
        "labels": torch.ones(1, 9, dtype=torch.long),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]]),
    }
    padded = pad_to_multiple(row, 4)  # 3 padding tokens: their own segment
    kwargs = packed_attention_kwargs(padded["position_ids"])
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 4, 6, 9, 12]
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32 and kwargs["cu_seq_lens_k"] is kwargs["cu_seq_lens_q"]
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 4


def test_vlm_rows_use_the_text_channel() -> None:
    text = torch.tensor([0, 1, 2, 0, 1])
    mrope = torch.tensor([[0, 1, 1, 0, 5]] * 3)  # T/H/W ids never decide the segments
    kwargs = packed_attention_kwargs(torch.cat([text[None], mrope])[:, None])  # (4, 1, L): upstream's layout
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 5]
    assert kwargs["max_length_q"] == 3


def test_rejects_rows_that_do_not_start_a_segment() -> None:
    with pytest.raises(ValueError, match="must start at 0"):
        packed_attention_kwargs(torch.tensor([[3, 4, 0, 1]]))
    with pytest.raises(ValueError, match="one packed row"):
        packed_attention_kwargs(torch.zeros(2, 4, dtype=torch.long))
