"""runtime/sp/vision.py hooks: identity with SP off; on 2 gloo ranks equal to the single-process computation."""

from __future__ import annotations

import pytest
import torch

from runtime.sp import vision
from tests.dist_utils import run_distributed


def test_hooks_are_identity_when_sp_is_off() -> None:
    x = torch.randn(10, 4)
    pe = (torch.randn(10, 2), torch.randn(10, 2))
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    assert vision.vit_pad_length(10, 4) == 0
    assert vision.vit_pad_and_slice(x, 0) is x
    assert vision.vit_pad_and_slice(pe, 0) is pe
    assert vision.vit_pad_cu_seqlens(cu, 0) is cu
    assert vision.vit_gather(x, 0) is x
    levels = [x, x]
    assert vision.vit_gather(levels, 0) is levels
    q = torch.randn(1, 4, 10, 8)
    assert vision.vit_all_to_all((q,), to="heads", seq_dim=2, head_dim=1)[0] is q
    out = vision.local_visual_tokens(torch.ones(1, 10, dtype=torch.bool), x, levels)
    assert out[0] is x and out[1] is levels


def test_cu_seqlens_pad_segment() -> None:
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    assert vision.vit_pad_cu_seqlens(cu, 6).tolist() == [0, 6, 10, 16]


def _vit_worker(rank: int, world_size: int, x: torch.Tensor, mask: torch.Tensor, embeds: torch.Tensor) -> dict:
    """Pad+slice -> per-row op -> all-to-all round trip -> gather; and fill-back of visual tokens, with grads."""
    from runtime.parallel.state import init_parallel_state

    state = init_parallel_state(sp_size=world_size)
    x = x.clone().requires_grad_(True)
    pad = vision.vit_pad_length(x.shape[0], 2)
    local = vision.vit_pad_and_slice(x, pad)
    cos_sin = vision.vit_pad_and_slice((x[:, 0], x[:, 1]), pad)
    heads = local.reshape(1, local.shape[0], 4, -1).transpose(1, 2)  # (1, heads, local patches, d)
    (full_heads,) = vision.vit_all_to_all((heads,), to="heads", seq_dim=2, head_dim=1)
    (back,) = vision.vit_all_to_all((full_heads.transpose(1, 2) * 2,), to="sequence", seq_dim=1, head_dim=2)
    gathered = vision.vit_gather(back.reshape(local.shape) + local, pad)
    deep = vision.vit_gather([local * 3], pad)[0]
    out = (gathered * torch.arange(1.0, 1 + gathered.numel()).reshape(gathered.shape)).sum() + deep.sum()
    (out / world_size).backward()  # `out` is replicated: each rank owns 1/sp of it (partial-gradient convention)
    x_grad = x.grad.clone()
    torch.distributed.all_reduce(x_grad, group=state.sp_group)

    e = embeds.clone().requires_grad_(True)
    local_len = mask.shape[1] // world_size
    local_mask = mask[:, rank * local_len : (rank + 1) * local_len]
    picked, picked_levels = vision.local_visual_tokens(local_mask, e, [e * 2])
    # transformers >= 5.23: each deepstack level split per image (here 3 + rest); the rows of their concatenation
    (split_levels,) = vision.local_visual_tokens(local_mask, [tuple(torch.split(e * 2, [3, e.shape[0] - 3]))])
    return {
        "pad": pad,
        "local_rows": local.shape[0],
        "cos_rows": cos_sin[0].shape[0],
        "full_heads": tuple(full_heads.shape),
        "gathered": gathered.detach(),
        "deep": deep.detach(),
        "x_grad": x_grad,
        "picked": picked.detach(),
        "picked_level": picked_levels[0].detach(),
        "split_level": [piece.detach() for piece in split_levels[0]],
        "local_mask": local_mask,
    }


@pytest.mark.dist
def test_vit_hooks_on_two_ranks_match_single_process() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=g)  # 10 patches, padded to 12 (multiple of sp * pad_scale = 4)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 2:7] = True  # row 0: visual tokens on both ranks
    mask[1, 1:3] = True  # row 1: on rank 0 only
    embeds = torch.randn(int(mask.sum()), 5, generator=g)
    per_rank = run_distributed(_vit_worker, 2, x, mask, embeds, timeout=120)

    ref_x = x.clone().requires_grad_(True)
    ref_gathered = ref_x * 2 + ref_x
    ref_out = (ref_gathered * torch.arange(1.0, 1 + ref_x.numel()).reshape(ref_x.shape)).sum() + (ref_x * 3).sum()
    ref_out.backward()
    ordinal = torch.cumsum(mask.reshape(-1), 0).reshape(mask.shape) - 1
    for rank, got in enumerate(per_rank):
        assert got["pad"] == 2 and got["local_rows"] == 6 and got["cos_rows"] == 6
        assert got["full_heads"] == (1, 2, 12, 2)
        torch.testing.assert_close(got["gathered"], ref_gathered.detach(), rtol=0, atol=0)
        torch.testing.assert_close(got["deep"], ref_x.detach() * 3, rtol=0, atol=0)
        torch.testing.assert_close(got["x_grad"], ref_x.grad, rtol=1e-6, atol=1e-6)
        index = ordinal[:, rank * 4 : (rank + 1) * 4][got["local_mask"]]
        assert torch.equal(got["picked"], embeds[index])
        assert torch.equal(got["picked_level"], embeds[index] * 2)
        assert len(got["split_level"]) == 1 and torch.equal(got["split_level"][0], embeds[index] * 2)
    # the ranks' picks, placed row-major into their slices, are masked_scatter's global order
    assert per_rank[1]["picked"].shape[0] == int(mask[:, 4:].sum()) == 3
