"""Tiny random-initialised models and batches for tests and demos (no downloads, fp32, seconds on a CPU)."""

from __future__ import annotations

import torch
import transformers

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    use_cache=False,
)


# MoE extras: 8 experts, top-2, every layer sparse; eager experts (the numerical reference) unless overridden.
TINY_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    decoder_sparse_step=1,
    norm_topk_prob=True,
    output_router_logits=True,
    router_aux_loss_coef=0.01,
)


# VLM (qwen3_vl family): the text sub-config is TINY (M-RoPE sections sum to head_dim / 2); a 3-block ViT whose
# deepstack taps (blocks 0 and 1) lie inside its depth and feed both text layers; 4 ViT heads so sp=2/4 divide them.
TINY_VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    out_hidden_size=TINY["hidden_size"],
    patch_size=4,
    temporal_patch_size=2,
    in_channels=3,
    spatial_merge_size=2,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 1],
)
# qwen2_5_vl: the same ViT without the learned position embedding and deepstack, windowed instead: 16-pixel
# windows (2x2 merged tokens, so the test images span several windows) in blocks 0 and 1, full attention in block 2;
# its M-RoPE is the non-interleaved T/H/W sections.
TINY_VISION_WINDOWED = {
    **{k: v for k, v in TINY_VISION.items() if k not in ("num_position_embeddings", "deepstack_visual_indexes")},
    "window_size": 16,
    "fullatt_block_indexes": [2],
}
TINY_VLM_TOKENS = dict(image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)
VLM_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl")


def tiny_vlm_text_config(model_type: str) -> dict:
    """The text sub-config of a tiny VLM as plain data (a run config's ``model.config.text_config``)."""
    moe = TINY_MOE if model_type.endswith("_moe") else {}
    windowed = model_type == "qwen2_5_vl"
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        **({} if windowed else {"mrope_interleaved": True}),
    }
    special = {"bos_token_id": None, "eos_token_id": None} if windowed else {}  # its defaults lie outside TINY's vocab
    return {**TINY, **moe, **special, "rope_parameters": rope}


def _tiny_vlm_config(model_type: str, **overrides) -> transformers.PretrainedConfig:
    windowed = model_type == "qwen2_5_vl"
    text = {**tiny_vlm_text_config(model_type), **overrides.pop("text_config", {})}
    vision = {**(TINY_VISION_WINDOWED if windowed else TINY_VISION), **overrides.pop("vision_config", {})}
    return transformers.AutoConfig.for_model(
        model_type,
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        **{**TINY_VLM_TOKENS, **overrides},
    )


def tiny_config(model_type: str, **overrides) -> transformers.PretrainedConfig:
    """A small config of `model_type`; training configs never use a KV cache (it also disables packing masks)."""
    if model_type in VLM_TYPES:
        experts_implementation = overrides.pop("experts_implementation", "eager")
        config = _tiny_vlm_config(model_type, **overrides)
        config._attn_implementation = "sdpa"
        if model_type.endswith("_moe"):
            config._experts_implementation = experts_implementation  # propagates to the text sub-config
        return config
    extras = TINY_MOE if model_type.endswith("_moe") else {}
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **extras, **overrides})
    config._attn_implementation = "sdpa"
    if extras:
        config._experts_implementation = overrides.get("experts_implementation", "eager")
    return config


def random_packed_batch(lengths: tuple[int, ...], vocab_size: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """One row holding several sequences: position ids restart per sequence, no label crosses a boundary."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (1, sum(lengths)), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = input_ids.clone()
    labels[position_ids == 0] = -100  # a sequence's first token is nobody's target
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


def _vision_tokens(
    config, kind: str, grid: tuple[int, int, int], merge: int, g: torch.Generator, text_id_limit: int
) -> tuple[list[int], list[int]]:
    """Token ids and mm_token_type_ids of one image or video, as the model family's processor lays them out."""
    t, h, w = grid
    start, end = config.vision_start_token_id, config.vision_end_token_id
    if kind == "image":
        pads = [config.image_token_id] * (t * h * w // merge)
        return [start, *pads, end], [0, *[1] * len(pads), 0]
    pads = [config.video_token_id] * (h * w // merge)
    if config.model_type.startswith("qwen3_vl"):  # a timestamp (text) before each frame group, each framed alone
        ids, types = [], []
        for _ in range(t):
            ids += [int(torch.randint(1, text_id_limit, (1,), generator=g)), start, *pads, end]
            types += [0, 0, *[2] * len(pads), 0]
        return ids, types
    pads = pads * t  # qwen2_5_vl: one run of t * h * w / merge tokens
    return [start, *pads, end], [0, *[2] * len(pads), 0]


def random_vlm_batch(
    grids: tuple[tuple[int, int, int], ...],
    text_lengths: tuple[int, ...],
    config,
    seed: int = 1,
    videos: tuple[tuple[int, int, int], ...] = (),
) -> dict[str, torch.Tensor]:
    """One row: text_lengths[0] tokens, image 0, text_lengths[1] tokens, ..., then the videos the same way
    (len(text_lengths) == len(grids) + len(videos) + 1), laid out as the processor would (vision_start, image or
    video tokens, vision_end; qwen3_vl videos: a timestamp token and a frame per temporal patch), no processor.

    Grids are (t, h, w) in patches; h and w must be multiples of the spatial merge size. pixel_values(_videos) hold
    one flattened patch per row, (sum t*h*w, channels * temporal_patch * patch**2), random normal. Keys of a
    modality without any item are left out.
    """
    vision = config.vision_config
    merge = vision.spatial_merge_size**2
    g = torch.Generator().manual_seed(seed)
    special = min(
        config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id
    )
    media = [("image", grid) for grid in grids] + [("video", grid) for grid in videos]
    if len(text_lengths) != len(media) + 1:
        raise ValueError(f"need {len(media) + 1} text lengths around {len(media)} images/videos, got {text_lengths}")
    ids, types = [], []
    for index, n in enumerate(text_lengths):
        ids.append(torch.randint(1, special, (n,), generator=g))
        types.append(torch.zeros(n, dtype=torch.int32))
        if index < len(media):
            tokens, kinds = _vision_tokens(config, *media[index], merge, g, special)
            ids.append(torch.tensor(tokens))
            types.append(torch.tensor(kinds, dtype=torch.int32))
    input_ids = torch.cat(ids)[None]
    labels = input_ids.clone()
    visual = (input_ids == config.image_token_id) | (input_ids == config.video_token_id)
    labels[visual | (input_ids == config.vision_start_token_id)] = -100
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    batch = {"input_ids": input_ids, "labels": labels, "mm_token_type_ids": torch.cat(types)[None]}
    for pixels, grid_key, items in (
        ("pixel_values", "image_grid_thw", grids),
        ("pixel_values_videos", "video_grid_thw", videos),
    ):
        if items:
            patches = sum(t * h * w for t, h, w in items)
            batch[pixels] = torch.randn(patches, patch_dim, generator=g)
            batch[grid_key] = torch.tensor(items, dtype=torch.long)
    return batch
