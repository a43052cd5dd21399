"""A key mask that hides some of the sharded tokens' keys stays hidden under SP: Ulysses and a ring alike.

The SP attention used to take every sharded column of a joint ``[text, image]`` key mask as valid: a model that
masks some of its sharded tokens (padded latents, say) then attended to them under sp=2 with exit 0. The ring then
refused such masks; it now hides them per ring rank (Lumina2's per-sample ``[text, image, pad]`` layout needs it).
"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed

TEXT, IMAGE, HEADS, DIM = 2, 5, 2, 4  # 5 image tokens over sp=2: padded to 6, 3 per rank


def _full_inputs():
    import torch

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, TEXT + IMAGE, HEADS, DIM, generator=g) for _ in range(3))
    mask = torch.ones(1, 1, 1, TEXT + IMAGE, dtype=torch.bool)
    mask[..., 1] = False  # a padded text key
    mask[..., TEXT + 3] = False  # a masked sharded (image) key, on rank 1
    return q, k, v, mask


def _local(x, rank: int, dim: int):
    import torch

    text, image = x.narrow(dim, 0, TEXT), x.narrow(dim, TEXT, IMAGE)
    shape = list(image.shape)
    shape[dim] = 1
    padded = torch.cat([image, torch.zeros(shape, dtype=x.dtype)], dim)  # the SP padding, as shard_tokens adds it
    return torch.cat([text, padded.narrow(dim, 3 * rank, 3)], dim)


def mask_worker(rank: int, world_size: int) -> dict:
    import torch.nn.functional as F

    from runtime.diffusion.sp import (
        AttentionSplit,
        TokenShard,
        ulysses_to_heads,
        ulysses_to_sequence,
    )
    from runtime.diffusion.sp_layout import AttentionLayout
    from runtime.parallel.state import init_parallel_state

    state = init_parallel_state(sp_size=world_size)
    q, k, v, mask = _full_inputs()

    def attend(q, k, v, mask):  # (b, s, h, d) in and out
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask=mask)
        return out.transpose(1, 2)

    reference = _local(attend(q, k, v, mask), rank, 1)
    shard = TokenShard(state.sp_group, world_size, rank, IMAGE, 1, ulysses_group=state.sp_group)
    split = AttentionSplit(shard, AttentionLayout("first", "bshd", "test site"))
    local = [_local(x, rank, 1) for x in (q, k, v)]
    q2, k2, v2, mask2 = ulysses_to_heads(split, *local, _local(mask, rank, 3))
    out = ulysses_to_sequence(split, attend(q2, k2, v2, mask2))
    error = ((out - reference).abs().max() / reference.abs().max()).item()
    return {"error": error}


def ring_mask_worker(rank: int, world_size: int, replicated: str) -> dict:
    """ring=2 (Ulysses 1): each sample's masked sharded keys (sample 1 masks a whole ring rank's span but one
    token) and a masked text key stay hidden, with the text first or last."""
    import torch
    import torch.nn.functional as F

    from runtime.diffusion.sp import AttentionSplit, TokenShard, ulysses_to_heads, ulysses_to_sequence
    from runtime.diffusion.sp_layout import AttentionLayout
    from runtime.diffusion.sp_ring import ring_dispatch
    from runtime.parallel.state import init_parallel_state

    state = init_parallel_state(sp_size=world_size, ring_size=world_size)
    g = torch.Generator().manual_seed(1)
    text_at = 0 if replicated == "first" else IMAGE
    q, k, v = (torch.randn(2, TEXT + IMAGE, HEADS, DIM, generator=g) for _ in range(3))
    mask = torch.ones(2, 1, 1, TEXT + IMAGE, dtype=torch.bool)
    image_at = TEXT if replicated == "first" else 0
    mask[0, ..., text_at + 1] = False  # a padded text key
    mask[0, ..., image_at + 3] = False  # a masked image key on ring rank 1
    mask[1, ..., image_at + 1 : image_at + IMAGE] = False  # sample 1: every image key but its first

    def attend(q, k, v, mask):  # (b, s, h, d) in and out
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask=mask)
        return out.transpose(1, 2)

    def local(x, dim):
        text, image = x.narrow(dim, text_at, TEXT), x.narrow(dim, image_at, IMAGE)
        shape = list(image.shape)
        shape[dim] = 1
        mine = torch.cat([image, torch.zeros(shape, dtype=x.dtype)], dim).narrow(dim, 3 * rank, 3)
        return torch.cat([text, mine] if replicated == "first" else [mine, text], dim)

    reference = local(attend(q, k, v, mask), 1)
    shard = TokenShard(
        state.sp_group,
        world_size,
        rank,
        IMAGE,
        1,
        ulysses_group=state.ulysses_group,
        ring_group=state.ring_group,
        ring_size=2,
    )
    split = AttentionSplit(shard, AttentionLayout(replicated, "bshd", "test site"))
    q2, k2, v2, mask2 = ulysses_to_heads(split, *(local(x, 1) for x in (q, k, v)), local(mask, 3))
    out = ulysses_to_sequence(split, ring_dispatch(split, attend)(q2, k2, v2, attn_mask=mask2))
    real = torch.ones(TEXT + 3, dtype=torch.bool)  # a padding query's output is dropped by gather_tokens
    if rank == 1:
        real[TEXT + 2 if replicated == "first" else 2] = False
    error = (out - reference)[:, real].abs().max() / reference[:, real].abs().max()
    return {"error": error.item()}


@pytest.mark.dist
def test_a_masked_sharded_key_stays_masked_under_ulysses() -> None:
    for result in run_distributed(mask_worker, 2, timeout=120):
        # the same sdpa over the same keys, reordered by the all-to-all: float rounding only (fp32)
        assert result["error"] < 1e-5


@pytest.mark.dist
@pytest.mark.parametrize("replicated", ["first", "last"])
def test_masked_sharded_keys_stay_masked_under_a_ring(replicated: str) -> None:
    for result in run_distributed(ring_mask_worker, 2, replicated, timeout=120):
        # log-sum-exp merge of two blocks vs one sdpa: fp32 rounding only
        assert result["error"] < 1e-5
