"""Random forward kwargs of a DiT transformer, one builder per condition model type (a spec's ``[model.data]
condition_model_type``), laid out as the condition model's ``process_condition`` lays them out, never zeros, with
token counts that sp = 2 and 4 do not divide (every SP run pads). The trainer's start-up self-check
(``runtime/train/self_check_dit.py``) feeds them to a shrunk copy of the job's transformer; the parity, SP,
checkpoint and pipeline suites (``tests/dit/cases.py``) and the RL export test feed them to the tiny transformers.
A new DiT adds its builder here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from runtime.config.errors import ConfigError

__all__ = ["example_inputs"]

Inputs = dict[str, Any]


def _auraflow(config: dict[str, Any], generator: torch.Generator) -> Inputs:
    """6x10 latents, patch 2 -> 3 x 5 = 15 image tokens (sp = 2 and 4 do not divide them: every SP run pads);
    7 text tokens, the last sample's last 3 zero vectors (the pipeline multiplies the UMT5 state by its mask and
    passes no mask: padded tokens are attended as zeros); ``timestep`` = sigma in [0, 1], as the pipeline passes
    it; a batch of 2."""
    batch, text = 2, 7
    encoder_hidden_states = torch.randn(batch, text, config["joint_attention_dim"], generator=generator)
    encoder_hidden_states[-1, text - 3 :] = 0
    return {
        "hidden_states": torch.randn(batch, config["in_channels"], 6, 10, generator=generator),
        "encoder_hidden_states": encoder_hidden_states,
        "timestep": torch.rand(batch, generator=generator),
        "return_dict": False,
    }


def _cogvideox(config: dict[str, Any], generator: torch.Generator) -> Inputs:
    """3 latent frames of 6x10, patch 2 -> 3 x 3 x 5 = 45 tokens (frames before channels, as the transformer
    takes them); ``max_text_seq_length`` text tokens (the position embeddings cover exactly that many, as the
    pipeline pads them); integer timesteps; the pipeline's RoPE when the config uses it."""
    from runtime.diffusion.conditions.cogvideox import TEXT_LENGTH, _rotary

    batch, frames, h, w = 2, 3, 6, 10
    text = config.get("max_text_seq_length", TEXT_LENGTH)
    out = {
        "hidden_states": torch.randn(batch, frames, config["in_channels"], h, w, generator=generator),
        "encoder_hidden_states": torch.randn(batch, text, config["text_embed_dim"], generator=generator),
        "timestep": torch.randint(0, 1000, (batch,), generator=generator),
        "return_dict": False,
    }
    rotary = _rotary(config, h * 8, w * 8, frames)
    if rotary is not None:
        out["image_rotary_emb"] = rotary
    return out


def _flux(config: dict[str, Any], generator: torch.Generator) -> Inputs:
    """3x5 = 15 packed image tokens, 7 text tokens, a batch of 2, guidance 3.5 where the config embeds it (as
    ``process_condition`` passes it: a class built without the embedding, Bria's, takes none)."""
    batch, h, w, text = 2, 3, 5, 7
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(h * w, 3).float()
    inputs = {
        "hidden_states": torch.randn(batch, h * w, config["in_channels"], generator=generator),
        "encoder_hidden_states": torch.randn(batch, text, config["joint_attention_dim"], generator=generator),
        "pooled_projections": torch.randn(batch, config["pooled_projection_dim"], generator=generator),
        "timestep": torch.rand(batch, generator=generator),
        "img_ids": img_ids,  # (0, row, col) per packed token, as FluxPipeline lays them out
        "txt_ids": torch.zeros(text, 3),
        "return_dict": False,
    }
    if config.get("guidance_embeds"):
        inputs["guidance"] = torch.full((batch,), 3.5)
    return inputs


def _ovis_image(config: dict[str, Any], generator: torch.Generator) -> Inputs:
    """Flux's layout without pooled projections or guidance: 3x5 = 15 packed image tokens, 7 text tokens at
    positions (0, i, i) as OvisImagePipeline lays them out, a batch of 2."""
    inputs = _flux({**config, "pooled_projection_dim": 1, "guidance_embeds": False}, generator)
    del inputs["pooled_projections"]
    positions = torch.arange(inputs["txt_ids"].shape[0], dtype=torch.float32)
    inputs["txt_ids"] = torch.stack([torch.zeros_like(positions), positions, positions], dim=-1)
    return inputs


def _hunyuanvideo(config: dict[str, Any], generator: torch.Generator) -> Inputs:
    """3 frames of 6x10 latents, patch 2 -> 3 x 3 x 5 = 45 tokens; 7 text tokens of which the last sample's last
    3 are padding; guidance 6.0 (x1000, as the pipeline passes it)."""
    batch, text = 2, 7
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[-1, text - 3 :] = 0
    return {
        "hidden_states": torch.randn(batch, config["in_channels"], 3, 6, 10, generator=generator),
        "timestep": torch.rand(batch, generator=generator) * 1000,
        "encoder_hidden_states": torch.randn(batch, text, config["text_embed_dim"], generator=generator),
        "encoder_attention_mask": mask,
        "pooled_projections": torch.randn(batch, config["pooled_projection_dim"], generator=generator),
        "guidance": torch.full((batch,), 6000.0),
        "return_dict": False,
    }


def _ltx_video(config: dict[str, Any], generator: torch.Generator) -> Inputs:
    """3 latent frames of 3x5, packed (patch 1, as released) -> 45 tokens; 7 text tokens, the last sample's last 3
    masked (the pipeline's boolean T5 mask); the latent grid and ``rope_interpolation_scale`` as ``LTXPipeline``
    passes them. The timestep is **per token** ``(b, tokens)``, the first latent frame's 15 tokens at 0, as
    ``LTXImageToVideoPipeline`` / ``LTXConditionPipeline`` pass it (``t * (1 - conditioning_mask)``): the form the
    spec's ``dit/shard_per_token`` splits; the per-sample form ``(b,)`` (``LTXPipeline``, ``process_condition``) runs
    in the pipeline, trainer and RL suites."""
    from runtime.diffusion.conditions.ltx_video import FRAME_RATE

    batch, frames, h, w, text = 2, 3, 3, 5, 7
    tokens = frames * h * w
    mask = torch.ones(batch, text, dtype=torch.bool)
    mask[-1, text - 3 :] = False
    timestep = (torch.rand(batch, generator=generator) * 1000)[:, None].repeat(1, tokens)
    timestep[:, : h * w] = 0
    return {
        "hidden_states": torch.randn(batch, tokens, config["in_channels"], generator=generator),
        "encoder_hidden_states": torch.randn(batch, text, config["caption_channels"], generator=generator),
        "timestep": timestep,
        "encoder_attention_mask": mask,
        "num_frames": frames,
        "height": h,
        "width": w,
        "rope_interpolation_scale": (8 / FRAME_RATE, 32, 32),
        "return_dict": False,
    }


def _lumina2(config: dict[str, Any], generator: torch.Generator) -> Inputs:
    """6x10 latents, patch 2 -> 3 x 5 = 15 image tokens (sp = 2 and 4 do not divide them: every SP run pads);
    7 caption tokens of which the first sample uses all and the second 4 (right padding, ones first, as the
    pipeline's Gemma2 mask), so the per-sample joint [caption, image, pad] layout has two lengths (22 and 19);
    ``timestep`` in [0, 1] (Lumina's ``1 - sigma``); a batch of 2."""
    batch, text = 2, 7
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[1, 4:] = 0
    return {
        "hidden_states": torch.randn(batch, config["in_channels"], 6, 10, generator=generator),
        "timestep": torch.rand(batch, generator=generator),
        "encoder_hidden_states": torch.randn(batch, text, config["cap_feat_dim"], generator=generator),
        "encoder_attention_mask": mask,
        "return_dict": False,
    }


def _pixart_sigma(config: dict[str, Any], generator: torch.Generator) -> Inputs:
    """6x10 latents, patch 2 -> 3 x 5 = 15 image tokens (sp = 2 and 4 do not divide them: every SP run pads); 7 text
    tokens, the last sample's last 3 masked (the pipeline's T5 attention mask); integer timesteps; no resolution or
    aspect-ratio conditions, as PixArtSigmaPipeline passes them; a batch of 2."""
    batch, text = 2, 7
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[-1, text - 3 :] = 0
    return {
        "hidden_states": torch.randn(batch, config["in_channels"], 6, 10, generator=generator),
        "encoder_hidden_states": torch.randn(batch, text, config["caption_channels"], generator=generator),
        "encoder_attention_mask": mask,
        "timestep": torch.randint(0, 1000, (batch,), generator=generator),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
        "return_dict": False,
    }


def _qwenimage(config: dict[str, Any], generator: torch.Generator) -> Inputs:
    """3x5 = 15 packed image tokens (zero_cond_t: plus a 2x3 condition image, batch 1), 7 text tokens of which
    the last sample's last 2 are padding."""
    h, w, text = 3, 5, 7
    zero_cond_t = bool(config.get("zero_cond_t"))
    batch = 1 if zero_cond_t else 2
    shapes = [(1, h, w), (1, 2, 3)] if zero_cond_t else [(1, h, w)]
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[-1, text - 2 :] = 0
    tokens = sum(f * y * x for f, y, x in shapes)
    return {
        "hidden_states": torch.randn(batch, tokens, config["in_channels"], generator=generator),
        "encoder_hidden_states": torch.randn(batch, text, config["joint_attention_dim"], generator=generator),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.rand(batch, generator=generator),
        "img_shapes": [shapes] * batch,
        "return_dict": False,
    }


def _sana(config: dict[str, Any], generator: torch.Generator) -> Inputs:
    """8x5 latents, patch 1 -> 8 x 5 = 40 tokens in 8 grid rows (Sana's conv feed-forward splits whole rows: sp = 2
    and 4 divide the rows, so no run pads); 7 text tokens, the last sample's last 2 masked (the pipeline's
    attention mask); a batch of 2."""
    batch, text = 2, 7
    mask = torch.ones(batch, text)
    mask[-1, -2:] = 0
    return {
        "hidden_states": torch.randn(batch, config["in_channels"], 8, 5, generator=generator),
        "encoder_hidden_states": torch.randn(batch, text, config["caption_channels"], generator=generator),
        "encoder_attention_mask": mask,
        "timestep": torch.rand(batch, generator=generator) * 1000,
        "return_dict": False,
    }


def _sd3(config: dict[str, Any], generator: torch.Generator) -> Inputs:
    """6x10 latents, patch 2 -> 3 x 5 = 15 tokens; 7 text tokens; a batch of 2."""
    batch, text = 2, 7
    return {
        "hidden_states": torch.randn(batch, config["in_channels"], 6, 10, generator=generator),
        "encoder_hidden_states": torch.randn(batch, text, config["joint_attention_dim"], generator=generator),
        "pooled_projections": torch.randn(batch, config["pooled_projection_dim"], generator=generator),
        "timestep": torch.rand(batch, generator=generator) * 1000,
        "return_dict": False,
    }


def _wan(config: dict[str, Any], generator: torch.Generator, variant: str | None = None) -> Inputs:
    """3 frames of 6x10 latents -> 3 x 3 x 5 = 45 tokens; I2V: batch 1 with exactly 512 text tokens (its
    attention splits image and text context there) and 5 CLIP image tokens. Wan2.2 TI2V (variant ``ti2v``):
    per-token timesteps ``(batch, tokens)`` as the pipelines' ``expand_timesteps`` lays them out, the first
    frame's 15 tokens at 0 (first-frame conditioning)."""
    from runtime.diffusion.conditions.wan import TEXT_LENGTH

    i2v = bool(config.get("image_dim"))
    batch, text = (1, TEXT_LENGTH) if i2v else (2, 7)
    timestep = torch.rand(batch, generator=generator) * 1000
    if variant == "ti2v":
        timestep = timestep[:, None].repeat(1, 45)
        timestep[:, :15] = 0
    out = {
        "hidden_states": torch.randn(batch, config["in_channels"], 3, 6, 10, generator=generator),
        "timestep": timestep,
        "encoder_hidden_states": torch.randn(batch, text, config["text_dim"], generator=generator),
        "return_dict": False,
    }
    if i2v:
        out["encoder_hidden_states_image"] = torch.randn(batch, 5, config["image_dim"], generator=generator)
    return out


_BUILDERS: dict[str, Callable[[dict[str, Any], torch.Generator], Inputs]] = {
    "auraflow": _auraflow,
    "cogvideox": _cogvideox,
    "flux": _flux,
    "hunyuanvideo": _hunyuanvideo,
    "ltx_video": _ltx_video,
    "lumina2": _lumina2,
    "ovis_image": _ovis_image,
    "pixart_sigma": _pixart_sigma,
    "qwenimage": _qwenimage,
    "sana": _sana,
    "sd3": _sd3,
    "wan": _wan,
}


def example_inputs(
    condition_model_type: str, config: dict[str, Any], generator: torch.Generator, variant: str | None = None
) -> Inputs:
    """Random forward kwargs, with ``return_dict=False``, for a transformer built from ``config`` whose spec names
    ``condition_model_type``; identical for identically seeded generators. ``variant``: the spec's tiny variant,
    for a builder whose inputs differ by more than the config (a builder takes it as a ``variant`` parameter)."""
    if condition_model_type not in _BUILDERS:
        raise ConfigError(  # a newcomer's new condition model: one line, exit 2 (the self-check builds its inputs)
            f"no example inputs for condition model {condition_model_type!r}: the start-up self-check and the DiT "
            f"suites build random transformer inputs from a builder in runtime/diffusion/conditions/example_inputs.py "
            f"(known: {', '.join(sorted(_BUILDERS))}); add one for it (docs/adding-a-model.md, DiTs)"
        )
    builder = _BUILDERS[condition_model_type]
    if variant is not None and "variant" in inspect.signature(builder).parameters:
        return builder(config, generator, variant=variant)
    return builder(config, generator)
