"""A key mask that hides some of the sharded tokens' keys stays hidden under SP (or is refused under a ring).

The SP attention used to take every sharded column of a joint ``[text, image]`` key mask as valid: a model that
masks some of its sharded tokens (padded latents, say) then attended to them under sp=2 with exit 0.
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
        _sharded_key_mask,
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
    ring = TokenShard(state.sp_group, world_size, rank, IMAGE, 1, ring_size=2)
    try:
        _sharded_key_mask(ring, _local(mask, rank, 3).narrow(3, TEXT, 3), "test site")
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {"error": ((out - reference).abs().max() / reference.abs().max()).item(), "refused": refused}


@pytest.mark.dist
def test_a_masked_sharded_key_stays_masked_under_ulysses_and_is_refused_under_a_ring() -> None:
    for result in run_distributed(mask_worker, 2, timeout=120):
        # the same sdpa over the same keys, reordered by the all-to-all: float rounding only (fp32)
        assert result["error"] < 1e-5
        assert "hides some of the sharded tokens' keys" in result["refused"]
