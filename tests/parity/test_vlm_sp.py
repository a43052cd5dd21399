"""The VLMs under Ulysses SP=2 (two gloo ranks) against the single-process run: loss, logits and every gradient
(text model, ViT, merger, deepstack mergers; qwen2_5_vl's windowed ViT; qwen3_vl_moe's experts and router, with the
load-balancing loss on) within 1e-5 relative.

Each rank gets its slice of the tokens, the full pixel_values (the ViT hooks pad + slice the patches), and the
global 4-channel M-RoPE position ids (a text row for the packing mask, then T/H/W) in upstream's channels-first
layout (4, bs, L), as the data pipeline hands them over (runtime/data/sp_batch.py).
"""

from __future__ import annotations

import pytest
import torch

from runtime.models.registry import lookup, model_types, variant_cases, variant_overrides
from tests.dist_utils import run_distributed
from tests.parity.dense import grads
from tests.parity.vlm import vlm_batch, vlm_models
from tests.supports import require
from tests.tolerance import assert_within_rounding

MODELS = model_types("vlm")
DEEPSTACK = set(model_types("vlm", capability="deepstack"))
# (grids, text lengths): images on both ranks, no patch padding (32 patches); then both images on rank 0 only
# (rank 1 holds no image token) and 28 patches, so the ViT pads 4 patches on the last rank.
CASES = [
    (((1, 4, 6), (1, 2, 4)), (5, 7, 4)),
    (((1, 4, 6), (1, 2, 2)), (2, 1, 21)),
]
# An image and a 3-frame-group video in one row (qwen3_vl: the joint image+video deepstack path): the video's 12
# patches pad to 16 in the ViT, and its tokens straddle the two ranks' slices.
VIDEO_CASE = (((1, 2, 4),), (4, 3, 6), ((3, 2, 2),))


def forward_kwargs(model_type: str) -> dict:
    """MoE: upstream adds the load-balancing loss only when asked per call (under SP it is the global one)."""
    return {"output_router_logits": True} if lookup(model_type).is_moe else {}


def full_batch(model_type: str, grids, text, videos=()) -> dict[str, torch.Tensor]:
    """The whole row with global position ids (4, bs, L): text row, then upstream's get_rope_index T/H/W rows."""
    _, model = vlm_models(model_type)
    batch = vlm_batch(model_type, grids, text, videos=videos)
    mrope, _ = model.model.get_rope_index(
        batch["input_ids"], batch["mm_token_type_ids"], batch.get("image_grid_thw"), batch.get("video_grid_thw")
    )
    length = batch["input_ids"].shape[1]
    text_row = torch.arange(length)[None, None]
    batch["position_ids"] = torch.cat([text_row, mrope], dim=0)  # (4, bs, L): upstream's layout
    return batch


def pad_row(batch: dict[str, torch.Tensor], sp: int) -> dict[str, torch.Tensor]:
    """Pad the row to a multiple of sp with a padding segment (labels ignored, own positions)."""
    length = batch["input_ids"].shape[1]
    pad = -length % sp
    out = dict(batch)
    if pad:
        out["input_ids"] = torch.cat([batch["input_ids"], torch.zeros(1, pad, dtype=torch.long)], 1)
        out["labels"] = torch.cat([batch["labels"], torch.full((1, pad), -100)], 1)
        out["mm_token_type_ids"] = torch.cat([batch["mm_token_type_ids"], torch.zeros(1, pad, dtype=torch.int32)], 1)
        out["position_ids"] = torch.cat([batch["position_ids"], torch.arange(pad).expand(4, 1, pad)], 2)
    return out


def shard(batch: dict[str, torch.Tensor], sp: int, rank: int, ring: int = 1) -> dict[str, torch.Tensor]:
    """Pad the row to a multiple of sp (pad_row), mark the real tokens (token_mask: the padding is routed by MoE
    layers but counts nowhere in the load-balancing loss), then keep this rank's slice of the tokens."""
    from runtime.sp.layout import pad_multiple, rank_token_index

    out = pad_row(batch, pad_multiple(sp, ring))
    out["token_mask"] = torch.arange(out["input_ids"].shape[1])[None] < batch["input_ids"].shape[1]
    index = rank_token_index(out["input_ids"].shape[1], sp, ring, rank)  # zigzag chunks under a ring
    for key in ("input_ids", "labels", "mm_token_type_ids", "token_mask"):
        out[key] = out[key][:, index]
    return out


def sp_vlm_worker(
    rank: int, world_size: int, model_type: str, ring: int = 1, variant: str | None = None
) -> list[dict]:
    """SP = world size (the LM on Ulysses ``world / ring`` x ring ``ring``; the ViT on Ulysses over all of SP)."""
    import torch.distributed as dist

    from runtime.parallel.collectives import gather_along_dim
    from runtime.parallel.state import init_parallel_state
    from runtime.sp.layout import to_natural_order

    state = init_parallel_state(sp_size=world_size, ring_size=ring)
    results = []
    for case in [*CASES, VIDEO_CASE]:
        batch = full_batch(model_type, *case)
        _, model = vlm_models(model_type, **variant_overrides(model_type, variant))
        out = model(**shard(batch, world_size, state.sp_rank, ring), **forward_kwargs(model_type))
        out.loss.backward()
        partial = grads(model)
        for g in partial.values():  # partial-gradient convention: the true gradient is the sum over SP ranks
            dist.all_reduce(g, group=state.sp_group)
        logits = gather_along_dim(out.logits.detach(), 1, state.sp_group)
        logits = to_natural_order(logits, 1, world_size, ring)[:, : batch["input_ids"].shape[1]]
        results.append({"loss": out.loss.detach(), "logits": logits, "grads": partial})
    return results


def single_process(
    model_type: str, grids, text, videos=(), variant: str | None = None, dtype: torch.dtype = torch.float32
) -> dict:
    """The reference run: the unpadded row in one process (MoE: the load-balancing loss of its own tokens only);
    ``dtype=torch.float64``: weights and pixels in float64, the truth of the rounding model."""
    _, model = vlm_models(model_type, **variant_overrides(model_type, variant))
    model.to(dtype)
    batch = full_batch(model_type, grids, text, videos)
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
    out = model(**batch, **forward_kwargs(model_type))
    out.loss.backward()
    return {"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": grads(model)}


@pytest.mark.dist
@pytest.mark.parametrize(("model_type", "variant"), variant_cases(MODELS))  # each tiny variant's branches too
def test_vlm_sp2_matches_single_process(model_type: str, variant: str | None) -> None:
    require(model_type, "sp")
    per_rank = run_distributed(sp_vlm_worker, 2, model_type, 1, variant, timeout=300)
    for index, case in enumerate([*CASES, VIDEO_CASE]):
        ref = single_process(model_type, *case, variant=variant)
        truth = single_process(model_type, *case, variant=variant, dtype=torch.float64)
        if model_type in DEEPSTACK:
            assert any(n.startswith("model.visual.deepstack_merger_list.") for n in ref["grads"])
        if lookup(model_type).is_moe:
            assert any(n.endswith("mlp.gate.weight") for n in ref["grads"])
        for rank_results in per_rank:
            assert_within_rounding(rank_results[index], ref, truth, ["loss", "logits", "grads"], what=str(case))
