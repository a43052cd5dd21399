"""Shared pieces of the omni tests: the tiny thinker config, paired models with equal weights, and batches laid out
as Qwen3-Omni's processor lays them out (images, videos with or without their audio track, audios).

The tiny config exercises every patched path: deepstack taps (ViT blocks 0 and 1) inside a 3-block ViT, an audio
encoder with two layers whose front end convolves 2 windows at a time (``conv_chunksize``), attention windows of two
100-frame chunks (``n_window_infer``), 8 experts top-2 in both text layers, 4 heads everywhere (sp=2 divides them).
``n_window`` stays upstream's 50: ``_get_feat_extract_output_lengths`` hard-codes a 100-frame chunk's 13 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers

MODEL_TYPE = "qwen3_omni_moe_thinker"
TOKENS = dict(
    audio_token_id=100,
    image_token_id=101,
    video_token_id=102,
    vision_start_token_id=103,
    vision_end_token_id=104,
    audio_start_token_id=105,
    audio_end_token_id=106,
)
TINY_TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    use_cache=False,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    decoder_sparse_step=1,
    norm_topk_prob=True,
    router_aux_loss_coef=0.01,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
)
TINY_VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    out_hidden_size=64,
    patch_size=4,
    temporal_patch_size=2,
    in_channels=3,
    spatial_merge_size=2,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 1],
)
TINY_AUDIO = dict(
    num_mel_bins=16,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=48,
    d_model=32,
    max_source_positions=32,
    n_window=50,
    n_window_infer=200,
    conv_chunksize=2,
    downsample_hidden_size=8,
    output_dim=64,
)
MEL = TINY_AUDIO["num_mel_bins"]


def tiny_omni_config(experts_implementation: str = "eager") -> transformers.PretrainedConfig:
    config = transformers.Qwen3OmniMoeThinkerConfig(
        text_config=dict(TINY_TEXT),
        vision_config=dict(TINY_VISION),
        audio_config=dict(TINY_AUDIO),
        position_id_per_seconds=25,
        **TOKENS,
    )
    config._attn_implementation = "sdpa"
    config._experts_implementation = experts_implementation
    return config


def generated_class() -> type:
    from generated.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration

    return Qwen3OmniMoeThinkerForConditionalGeneration


def omni_models(seed: int = 0, experts_implementation: str = "eager"):
    """(upstream, generated) thinkers with identical weights, fp32, sdpa."""
    config = tiny_omni_config(experts_implementation)
    torch.manual_seed(seed)
    upstream = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa")
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
    video_times = [k * seconds_per_grid * 25 for k in range(t) for _ in range(per_frame)]
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


def shard(batch: dict, sp: int, rank: int) -> dict:
    """SP rank ``rank``'s inputs: its slice of the padded tokens and labels; position ids and media whole."""
    out = pad_row(batch, sp)
    local = out["input_ids"].shape[1] // sp
    for key in ("input_ids", "labels"):
        out[key] = out[key][:, rank * local : (rank + 1) * local]
    return out
