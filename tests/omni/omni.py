"""Shared pieces of the omni tests: the tiny thinker config, paired models with equal weights, and batches laid out
as Qwen3-Omni's processor lays them out (images, videos with or without their audio track, audios).

The tiny config is the spec's ``[model.tiny]``; its comment there says which patched path each value exercises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers

from runtime.models.registry import lookup
from runtime.models.tiny_configs import tiny_config, tiny_config_dict

MODEL_TYPE = "qwen3_omni_moe_thinker"
TINY = tiny_config_dict(MODEL_TYPE)  # the spec's [model.tiny]
TINY_TEXT, TINY_VISION, TINY_AUDIO = TINY["text_config"], TINY["vision_config"], TINY["audio_config"]
TOKENS = {k: v for k, v in TINY.items() if k.endswith("_token_id")}
MEL = TINY_AUDIO["num_mel_bins"]


def tiny_omni_config(experts_implementation: str = "eager") -> transformers.PretrainedConfig:
    return tiny_config(MODEL_TYPE, experts_implementation=experts_implementation)


def generated_class() -> type:
    return lookup(MODEL_TYPE).model_class()


def omni_models(seed: int = 0, experts_implementation: str = "eager"):
    """(upstream, generated) thinkers with identical weights, fp32, sdpa."""
    config = tiny_omni_config(experts_implementation)
    torch.manual_seed(seed)
    upstream = lookup(MODEL_TYPE).upstream_class().from_config(config, attn_implementation="sdpa")
    generated = generated_class()(config)
    generated.load_state_dict(upstream.state_dict())
    return upstream, generated


def audio_tokens(frames: int) -> int:
    """The audio encoder's output length for ``frames`` mel frames (upstream's formula)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    return int(_get_feat_extract_output_lengths(torch.tensor(frames), TINY_AUDIO["n_window"]))


def _interleaved(grid: tuple[int, int, int], seconds_per_grid: float, frames: int) -> list[int]:
    """Video and audio tokens of a video with its audio track, ordered by time as get_rope_index orders them."""
    t, h, w = grid
    per_frame = h * w // TINY_VISION["spatial_merge_size"] ** 2
    video_times = [k * seconds_per_grid * TINY["position_id_per_seconds"] for k in range(t) for _ in range(per_frame)]
    n_audio = audio_tokens(frames)
    out, v, a = [], 0, 0
    while v < len(video_times) and a < n_audio:
        if video_times[v] <= a:
            out.append(TOKENS["video_token_id"])
            v += 1
        else:
            out.append(TOKENS["audio_token_id"])
            a += 1
    out += [TOKENS["video_token_id"]] * (len(video_times) - v) + [TOKENS["audio_token_id"]] * (n_audio - a)
    return out


def omni_batch(items: Sequence[tuple], text: Sequence[int], seed: int = 1) -> dict:
    """One row: ``text[0]`` tokens, item 0, ``text[1]`` tokens, ... (``len(text) == len(items) + 1``).

    Items: ``("image", (t, h, w))``, ``("video", (t, h, w), seconds_per_grid)``, ``("audio", frames)`` and
    ``("video+audio", (t, h, w), seconds_per_grid, frames)`` (a video with its audio track; then every video of the
    row must have one: upstream's ``use_audio_in_video`` is per call). Random normal pixels and mel features,
    labels on text tokens and end markers, ``attention_mask`` of ones (upstream then computes the M-RoPE ids itself).
    """
    if len(text) != len(items) + 1:
        raise ValueError(f"need {len(items) + 1} text lengths around {len(items)} items")
    g = torch.Generator().manual_seed(seed)
    ids: list[torch.Tensor] = []
    images, videos, seconds, audios = [], [], [], []
    with_audio = {kind == "video+audio" for kind, *_ in items if kind.startswith("video")}
    if len(with_audio) > 1:
        raise ValueError("a row's videos either all have their audio track or none does")
    merge = TINY_VISION["spatial_merge_size"] ** 2
    t_ = TOKENS
    for k, n in enumerate(text):
        ids.append(torch.randint(1, 100, (n,), generator=g))
        if k == len(items):
            break
        kind, *spec = items[k]
        if kind == "image":
            (grid,) = spec
            images.append(grid)
            tokens = [t_["vision_start_token_id"], *[t_["image_token_id"]] * (grid[0] * grid[1] * grid[2] // merge)]
            tokens.append(t_["vision_end_token_id"])
        elif kind == "video":
            grid, spg = spec
            videos.append(grid)
            seconds.append(spg)
            tokens = [t_["vision_start_token_id"], *[t_["video_token_id"]] * (grid[0] * grid[1] * grid[2] // merge)]
            tokens.append(t_["vision_end_token_id"])
        elif kind == "audio":
            (frames,) = spec
            audios.append(frames)
            tokens = [t_["audio_start_token_id"], *[t_["audio_token_id"]] * audio_tokens(frames)]
            tokens.append(t_["audio_end_token_id"])
        elif kind == "video+audio":
            grid, spg, frames = spec
            videos.append(grid)
            seconds.append(spg)
            audios.append(frames)
            tokens = [t_["vision_start_token_id"], t_["audio_start_token_id"], *_interleaved(grid, spg, frames)]
            tokens += [t_["audio_end_token_id"], t_["vision_end_token_id"]]
        else:
            raise ValueError(f"unknown item kind {kind!r}")
        ids.append(torch.tensor(tokens))
    input_ids = torch.cat(ids)[None]
    # media tokens and start markers carry no label; the end markers do, so the last media token (and every
    # deepstack level, injected after the last text layer too) is a prediction the loss sees
    ends = (TOKENS["vision_end_token_id"], TOKENS["audio_end_token_id"])
    media = torch.isin(input_ids, torch.tensor([v for v in TOKENS.values() if v not in ends]))
    labels = input_ids.masked_fill(media, -100)
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": torch.ones_like(input_ids)}
    patch_dim = 3 * TINY_VISION["temporal_patch_size"] * TINY_VISION["patch_size"] ** 2
    for pixels, grids_key, grids in (
        ("pixel_values", "image_grid_thw", images),
        ("pixel_values_videos", "video_grid_thw", videos),
    ):
        if grids:
            batch[pixels] = torch.randn(sum(t * h * w for t, h, w in grids), patch_dim, generator=g)
            batch[grids_key] = torch.tensor(grids, dtype=torch.long)
    if videos:
        batch["video_second_per_grid"] = torch.tensor(seconds, dtype=torch.float)
        batch["use_audio_in_video"] = with_audio == {True}
    if audios:
        longest = max(audios)
        batch["input_features"] = torch.randn(len(audios), MEL, longest, generator=g)
        mask = torch.zeros(len(audios), longest, dtype=torch.long)
        for k, frames in enumerate(audios):
            mask[k, :frames] = 1
        batch["feature_attention_mask"] = mask
    return batch


def with_position_ids(batch: dict) -> dict:
    """The row as the data pipeline feeds it: global M-RoPE ids ``(4, 1, L)`` (the text row first, then upstream's
    T/H/W ids of the whole sample) instead of the attention mask."""
    fn = generated_class().get_position_id_func(tiny_omni_config())
    features = batch.get("feature_attention_mask")
    mrope = fn(
        batch["input_ids"],
        batch.get("image_grid_thw"),
        batch.get("video_grid_thw"),
        None if features is None else features.sum(-1),
        bool(batch.get("use_audio_in_video", False)),
        batch.get("video_second_per_grid"),
    )
    length = batch["input_ids"].shape[1]
    out = {k: v for k, v in batch.items() if k != "attention_mask"}
    out["position_ids"] = torch.cat([torch.arange(length)[None, None].to(mrope.dtype), mrope], 0)
    return out


def pad_row(batch: dict, sp: int) -> dict:
    """Pad the row to a multiple of sp with a padding segment (labels ignored, positions restart at 0)."""
    pad = -batch["input_ids"].shape[1] % sp
    out = dict(batch)
    if pad:
        out["input_ids"] = torch.cat([batch["input_ids"], torch.zeros(1, pad, dtype=torch.long)], 1)
        out["labels"] = torch.cat([batch["labels"], torch.full((1, pad), -100)], 1)
        positions = batch["position_ids"]
        out["position_ids"] = torch.cat([positions, torch.arange(pad).to(positions.dtype).expand(4, 1, pad)], 2)
    return out


def shard(batch: dict, sp: int, rank: int, ring: int = 1) -> dict:
    """SP rank ``rank``'s inputs: its slice of the padded tokens and labels (zigzag chunks under a ring,
    ``runtime.sp.layout``); position ids and media whole."""
    from runtime.sp.layout import pad_multiple, rank_token_index

    out = pad_row(batch, pad_multiple(sp, ring))
    index = rank_token_index(out["input_ids"].shape[1], sp, ring, rank)
    for key in ("input_ids", "labels"):
        out[key] = out[key][:, index]
    return out


def to_dtype(batch: dict, dtype: torch.dtype) -> dict:
    """``batch`` with its floating tensors (audio features, pixels) in ``dtype``: the float64 truth's inputs."""
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}
