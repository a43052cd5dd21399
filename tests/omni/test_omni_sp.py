"""The qwen3_omni_moe thinker under Ulysses SP=2 (two gloo ranks, one spawn for every case) against the single
process: loss, logits, the load-balancing loss and every gradient (audio encoder, ViT, mergers, deepstack mergers,
router, experts, text layers) within the rounding model (``tests.tolerance``; the float64 run the truth).

Each rank gets its slice of the tokens, the whole sample's pixels and mel features (the towers' SP hooks slice
their own sequences), and the global (4, 1, L) M-RoPE ids. Cases: audio, images and a video with its audio track
spread over both ranks; both images on rank 0 and the audio on rank 1 only (a rank without audio tokens, a rank
without image tokens); two audios whose lengths (37, 210 mel frames) are not multiples of the 100-frame window with
a video without audio track. The audio encoder's post-convolution sequence (33+17, 5+28 frames) is odd, so SP pads
it.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.omni.omni import TOKENS, omni_batch, omni_models, pad_row, shard, to_dtype, with_position_ids
from tests.parity.dense import grads
from tests.tolerance import assert_within_rounding

CASES = {
    "spread": (
        [("image", (1, 4, 6)), ("audio", 250), ("image", (1, 2, 4)), ("video+audio", (2, 2, 4), 1.0, 130)],
        (5, 3, 4, 2, 6),
    ),
    "images_rank0_audio_rank1": ([("image", (1, 4, 6)), ("image", (1, 2, 2)), ("audio", 130)], (2, 1, 24, 3)),
    "partial_windows": ([("audio", 37), ("video", (2, 2, 2), 0.5), ("audio", 210)], (4, 2, 3, 5)),
}
PARTS = ("audio_tower.conv2d1.", "audio_tower.layers.0.", "audio_tower.proj2.", "visual.blocks.0.", "visual.merger.")


def rows() -> dict[str, dict]:
    return {name: with_position_ids(omni_batch(*case)) for name, case in CASES.items()}


def sp_worker(rank: int, world_size: int, ring: int = 1, names: tuple[str, ...] = tuple(CASES)) -> dict:
    """SP = world size (the thinker's LM on Ulysses ``world / ring`` x ring ``ring``; the towers on Ulysses)."""
    import torch.distributed as dist

    from runtime.parallel.collectives import gather_along_dim
    from runtime.parallel.state import init_parallel_state
    from runtime.sp.layout import to_natural_order

    state = init_parallel_state(sp_size=world_size, ring_size=ring)
    results = {}
    for name, row in rows().items():
        if name not in names:
            continue
        _, model = omni_models()
        batch = shard(row, world_size, state.sp_rank, ring)
        ids = batch["input_ids"]
        local = {
            "audio": bool((ids == TOKENS["audio_token_id"]).any()),
            "image": bool((ids == TOKENS["image_token_id"]).any()),
        }
        out = model(**batch, output_router_logits=True)
        out.loss.backward()
        partial = grads(model)
        for g in partial.values():  # partial-gradient convention: the true gradient is the sum over SP ranks
            dist.all_reduce(g, group=state.sp_group)
        logits = gather_along_dim(out.logits.detach(), 1, state.sp_group)
        logits = to_natural_order(logits, 1, world_size, ring)[:, : row["input_ids"].shape[1]]
        results[name] = {"loss": out.loss.detach(), "aux": out.aux_loss.detach(), "logits": logits, "grads": partial}
        results[name]["local"] = local
    return results


def single_process(row: dict, sp: int, dtype: torch.dtype = torch.float32) -> dict:
    """On the row padded as for SP: the load-balancing loss routes the SP padding too (docs/parallelism.md);
    ``dtype=torch.float64``: the rounding model's truth."""
    _, model = omni_models()
    model.to(dtype)
    out = model(**to_dtype(pad_row(row, sp), dtype), output_router_logits=True)
    out.loss.backward()
    length = row["input_ids"].shape[1]
    return {
        "loss": out.loss.detach(),
        "aux": out.aux_loss.detach(),
        "logits": out.logits.detach()[:, :length],
        "grads": grads(model),
    }


@pytest.mark.dist
def test_omni_sp2_matches_single_process() -> None:
    per_rank = run_distributed(sp_worker, 2, timeout=300)
    locals_ = {name: [r[name]["local"] for r in per_rank] for name in CASES}
    # the layouts the cases are for
    assert locals_["images_rank0_audio_rank1"] == [{"audio": False, "image": True}, {"audio": True, "image": False}]
    assert all(loc["audio"] and loc["image"] for loc in locals_["spread"])
    for name, row in rows().items():
        ref, truth = single_process(row, 2), single_process(row, 2, torch.float64)
        for part in PARTS:
            assert any(n.startswith(part) for n in ref["grads"]), part
        for rank_results in per_rank:  # within the rounding model (tests.tolerance), the float64 run the truth
            assert_within_rounding(rank_results[name], ref, truth, ["loss", "aux", "logits", "grads"], what=name)
