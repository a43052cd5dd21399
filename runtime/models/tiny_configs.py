"""Tiny model configs (each spec's ``[model.tiny]`` table) and random batches shaped for them, so tests and demos
build random-initialised models without a download (fp32, seconds on a CPU). The ``python -m runtime.tiny`` command
(tokenizers, processors, DiT pipelines on disk) is ``runtime/tiny.py``."""

from __future__ import annotations

import copy
from typing import Any

import torch
import transformers

from patchgen.model import merge_tables  # the spec's own table merge (extends), data only
from runtime.models.registry import lookup


def tiny_config_dict(model_type: str) -> dict[str, Any]:
    """The tiny config of `model_type` as plain data: its spec's `[model.tiny]` table (a fresh deep copy)."""
    return copy.deepcopy(lookup(model_type).tiny)


def tiny_vlm_text_config(model_type: str) -> dict:
    """The text sub-config of a tiny VLM as plain data (a run config's ``model.config.text_config``)."""
    return tiny_config_dict(model_type)["text_config"]


def tiny_vision_config(model_type: str) -> dict:
    """The vision sub-config of a tiny VLM as plain data."""
    return tiny_config_dict(model_type)["vision_config"]


def tiny_config(model_type: str, **overrides) -> transformers.PretrainedConfig:
    """A small config of `model_type` (its spec's `[model.tiny]`, `overrides` merged in, sub-config tables
    key by key); sdpa attention (or the spec's ``[model.data] attn_implementation`` where transformers refuses sdpa,
    gpt_oss's eager), and eager experts (the numerical reference) for MoE models unless
    `experts_implementation` says otherwise. Training configs never use a KV cache (it also disables packing
    masks)."""
    entry = lookup(model_type)
    experts_implementation = overrides.pop("experts_implementation", "eager")
    config = transformers.AutoConfig.for_model(model_type, **merge_tables(tiny_config_dict(model_type), overrides))
    config._attn_implementation = entry.data.get("attn_implementation", "sdpa")
    if entry.is_moe:
        config._experts_implementation = experts_implementation  # propagates to a VLM's text sub-config
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
    layout = lookup(config.model_type).data.get("video_layout")
    if layout == "timestamped_frames":  # a timestamp (text) before each frame group, each framed alone
        ids, types = [], []
        for _ in range(t):
            ids += [int(torch.randint(1, text_id_limit, (1,), generator=g)), start, *pads, end]
            types += [0, 0, *[2] * len(pads), 0]
        return ids, types
    if layout != "one_run":
        raise ValueError(f"{config.model_type}: [model.data] video_layout must be timestamped_frames or one_run")
    pads = pads * t  # one run of t * h * w / merge tokens
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
