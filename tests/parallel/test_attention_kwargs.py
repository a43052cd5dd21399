"""What the SP attention functions do with the keyword arguments an attention module passes them.

Ring attention computes a causal softmax over documents (with a window when the layer has one) and attention sinks
(``s_aux``, gpt-oss: tests/parallel/test_ring_sinks.py); a logit softcap would change the softmax in a way it does
not compute, so it is refused instead of ignored (sinks used to be dropped: logits 0.18 off, the sinks without
gradient). Ulysses hands the arguments to the inner implementation, which attends with this rank's heads only:
per-head tensors are cut to those heads.
"""

from __future__ import annotations

import pytest
import torch

from runtime.sp.ulysses import heads_of_rank
from runtime.sp.usp import usp_attention


class _Attention(torch.nn.Module):
    is_causal = True
    scaling = 0.25


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)


@pytest.mark.parametrize("name, value", [("softcap", 30.0), ("logit_bias", torch.zeros(4))])
def test_ring_refuses_what_it_does_not_compute(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"does not compute .*{name}.*parallel.ring: 1"):
        usp_attention("sdpa")(_Attention(), *_qkv(), None, scaling=0.25, **{name: value})


def test_ring_takes_the_arguments_it_honours_to_the_mask_check() -> None:
    """The honoured arguments pass the refusal; the call then stops at the next check (it needs a RingMask)."""
    kwargs = {"dropout": 0.0, "scaling": 0.25, "sliding_window": None, "position_ids": None, "s_aux": torch.zeros(4)}
    with pytest.raises(ValueError, match="builds its masks itself"):
        usp_attention("sdpa")(_Attention(), *_qkv(), None, **kwargs)


def test_ulysses_cuts_per_head_arguments_to_this_ranks_heads() -> None:
    sinks = torch.arange(8.0)
    assert torch.equal(heads_of_rank({"s_aux": sinks}, 8, 2, 1)["s_aux"], torch.tensor([4.0, 5.0, 6.0, 7.0]))
    assert torch.equal(heads_of_rank({"s_aux": sinks}, 8, 4, 0)["s_aux"], torch.tensor([0.0, 1.0]))
    assert heads_of_rank({"scaling": 0.5}, 8, 2, 1) == {"scaling": 0.5}
    with pytest.raises(ValueError, match="one entry per query head"):
        heads_of_rank({"s_aux": torch.zeros(6)}, 8, 2, 0)
