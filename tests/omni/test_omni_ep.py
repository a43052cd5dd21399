"""The qwen3_omni_moe thinker with expert parallelism x Ulysses SP x FSDP2 (ep=2, sp=2: 4 gloo ranks, one spawn)
against the single-process eager run: the LM loss, the load-balancing loss and every gradient (audio encoder, ViT,
mergers, deepstack mergers, router, experts, text layers) within the rounding model (``tests.tolerance``; the float64
run the truth).

FSDP shards per block (decoder layers, ViT blocks, audio encoder layers), then the root. The two data-parallel
replicas train different rows. Replica 0: both images on SP rank 0's slice and the audio on
SP rank 1's (a rank without audio tokens, a rank without image tokens), no video. Replica 1: a video without audio
track and text only, so both of its ranks run the audio encoder and the ViT (images) on dummies, and replica 0 runs
the ViT on a dummy video: FSDP's collectives over the towers stay in step, and the dummies add exact zeros. The
reference packs both rows (each padded to a multiple of sp as under SP) into one row, media concatenated in order.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.omni.omni import TOKENS, omni_batch, omni_models, pad_row, shard, to_dtype, with_position_ids
from tests.tolerance import assert_within_rounding

ROWS = [
    ([("image", (1, 4, 6)), ("image", (1, 2, 2)), ("audio", 130)], (2, 1, 24, 3)),
    ([("video", (2, 2, 4), 0.5)], (9, 14)),
]
PACKED = {"input_ids": 1, "labels": 1, "position_ids": 2}
MEDIA = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "video_second_per_grid")
PARTS = (
    "audio_tower.conv2d1.",
    "audio_tower.layers.1.",
    "audio_tower.proj2.",
    "visual.blocks.2.",
    "visual.merger.",
    "visual.merger_list.0.",
    "mlp.gate.weight",
    "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj",
    "self_attn.q_proj",
)


def _model(experts_implementation: str):
    _, model = omni_models(experts_implementation=experts_implementation)
    with torch.no_grad():  # skewed routing, so some expert gets no token from some rank (uneven all-to-alls)
        for layer in model.model.layers:
            layer.mlp.gate.weight[:3] *= 4.0
    return model


def _rows() -> list[dict]:
    rows = []
    for items, text in ROWS:
        row = with_position_ids(omni_batch(items, text))
        row.pop("use_audio_in_video", None)  # only get_rope_index reads it; the ids are given
        row["labels"][:, 0] = -100  # a row's first token is nobody's target (see the packed reference)
        rows.append(row)
    return rows


def _targets(rows: list[dict]) -> int:
    return sum(int((r["labels"][:, 1:] != -100).sum()) for r in rows)


def _packed(rows: list[dict], sp: int) -> dict:
    padded = [pad_row(r, sp) for r in rows]
    out = {k: torch.cat([r[k] for r in padded], dim) for k, dim in PACKED.items()}
    for key in MEDIA:
        parts = [r[key] for r in padded if key in r]
        if parts:
            out[key] = torch.cat(parts)
    audio = [r for r in padded if "input_features" in r]
    longest = max(r["input_features"].shape[-1] for r in audio)
    out["input_features"] = torch.cat(
        [torch.nn.functional.pad(r["input_features"], (0, longest - r["input_features"].shape[-1])) for r in audio]
    )
    out["feature_attention_mask"] = torch.cat(
        [
            torch.nn.functional.pad(r["feature_attention_mask"], (0, longest - r["feature_attention_mask"].shape[-1]))
            for r in audio
        ]
    )
    return out


def reference(sp: int, dtype: torch.dtype = torch.float32) -> dict:
    """One process, eager experts (``dtype=torch.float64``: the rounding model's truth)."""
    model = _model("eager").to(dtype)
    out = model(**to_dtype(_packed(_rows(), sp), dtype), output_router_logits=True)
    out.loss.backward()
    coef = model.config.text_config.router_aux_loss_coef
    return {
        "lm": (out.loss - coef * out.aux_loss).detach(),
        "aux": out.aux_loss.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
    }


def parallel_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from runtime.moe.dispatch import register_experts_kernels
    from runtime.parallel.expert_parallel import apply_ep
    from runtime.parallel.fsdp import apply_fsdp
    from runtime.parallel.state import init_parallel_state

    register_experts_kernels()  # our kernels, in transformers' ExpertsInterface
    state = init_parallel_state(ep_size=2, sp_size=2)
    model = _model("patchgen_grouped")
    calls = {"audio": 0, "vision": 0}
    model.audio_tower.layers[0].register_forward_hook(lambda *_: calls.__setitem__("audio", calls["audio"] + 1))
    model.visual.blocks[0].register_forward_hook(lambda *_: calls.__setitem__("vision", calls["vision"] + 1))
    apply_ep(model, state)
    apply_fsdp(model, state)
    from torch.distributed.fsdp import FSDPModule

    units = [model.model.layers[0], model.visual.blocks[0], model.audio_tower.layers[0], model]
    assert all(isinstance(u, FSDPModule) for u in units)  # per-block units (fsdp/wrap_units), then the root
    rows = _rows()
    batch = shard(rows[state.dp_rank], state.sp_size, state.sp_rank)
    ids = batch["input_ids"]
    local = {
        "audio": bool((ids == TOKENS["audio_token_id"]).any()),
        "image": bool((ids == TOKENS["image_token_id"]).any()),
    }
    out = model(**batch, num_items_in_batch=_targets(rows), output_router_logits=True)
    out.loss.backward()
    coef = model.config.text_config.router_aux_loss_coef
    lm_share = (out.loss - coef * out.aux_loss).detach()
    dist.all_reduce(lm_share, group=state.dp_group)
    grads = {}
    for name, param in model.named_parameters():  # full_tensor is collective: every rank gathers every grad
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        grads[name.replace("_fsdp_wrapped_module.", "")] = grad
    return {
        "lm": lm_share,
        "aux": out.aux_loss.detach(),
        "calls": calls,
        "local": local,
        "grads": grads if rank == 0 else None,
    }


@pytest.mark.dist
def test_omni_ep2_sp2_matches_single_process() -> None:
    results = run_distributed(parallel_worker, 4, timeout=300)
    # ranks 0, 1: replica 0 (images on SP rank 0, audio on SP rank 1); ranks 2, 3: replica 1 (neither)
    assert [r["local"] for r in results] == [
        {"audio": False, "image": True},
        {"audio": True, "image": False},
        {"audio": False, "image": False},
        {"audio": False, "image": False},
    ]
    # every rank ran the audio encoder once (replica 1 on a dummy) and the ViT twice (images, videos; dummies)
    assert [r["calls"] for r in results] == [{"audio": 1, "vision": 2}] * 4
    ref, truth = reference(sp=2), reference(sp=2, dtype=torch.float64)
    for rank, got in enumerate(results):  # within the rounding model (tests.tolerance), the float64 run the truth
        assert_within_rounding(got, ref, truth, ["lm", "aux"] + (["grads"] if rank == 0 else []), what=f"rank {rank}")
    for part in PARTS:
        assert any(part in key for key in results[0]["grads"]), part
