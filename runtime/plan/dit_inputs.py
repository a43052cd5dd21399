"""A DiT's forward inputs for one clip or image of the workload's pixel size (built inside the fake mode).

The latent geometry is each family's VAE unless the plan's ``model`` names another (``vae_scale_factor_spatial``,
``vae_scale_factor_temporal``, as diffusers' pipelines call them): Wan 4x temporal, 8x spatial (latents
``(C, (F-1)/4+1, H/8, W/8)``, patch ``(1, 2, 2)``; Wan2.2 TI2V's VAE is 16x spatial); Flux and Qwen-Image 8x spatial
with 2x2 packing (``(H/16) * (W/16)`` tokens of 64 channels); Sana's DC-AE 32x spatial, patch 1; Lumina2 Flux's 8x VAE,
unpacked latents (the transformer patchifies, patch 2) and a caption mask of ones (every text token real: the
longest joint sequence); LTX-Video 8x temporal, 32x spatial, latents packed into ``((F-1)/8+1) * (H/32) * (W/32)``
tokens of 128 channels (patch 1) with the latent grid and ``rope_interpolation_scale`` (frame rate 25, the pipeline's
default) as ``LTXPipeline`` passes them, and a T5 mask of ones; AuraFlow SDXL's 8x VAE, unpacked latents (the
transformer patchifies, patch 2), no text mask (the transformer prepends its 8 register tokens to the text);
PixArt-Sigma the same 8x VAE, unpacked latents (patch 2), 300 T5 tokens with a mask of ones and no resolution
conditions (``added_cond_kwargs`` of Nones, as ``PixArtSigmaPipeline`` passes them). The
timestep stays fp32, as the pipelines pass it; with ``expand_timesteps`` (Wan2.2 TI2V) it is one per latent token, so
the per-token modulation tensors count.

``HOST_READS``: per model type, the submodules whose forward reads tensor values to the host, which a fake tensor
cannot give; the plan runs them on real tensors (``host_reads``). Lumina2's ``rope_embedder`` reads the caption
lengths from the mask (``attention_mask.sum(dim=1).tolist()``) and the transformer builds its per-sample joint
sequences from them in Python; so its caption mask is built as a real tensor (the values it reads), while its
latents stay fake (it reads only their shape).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from runtime import torch_compat
from runtime.plan.config import PlanModel, Workload

if TYPE_CHECKING:
    from diffusers.configuration_utils import FrozenDict

__all__ = ["HOST_READS", "dit_inputs"]

HOST_READS: dict[str, tuple[str, ...]] = {"lumina2": ("rope_embedder",)}  # model type -> submodule names


def _pixels(model_type: str, workload: Workload, video: bool) -> tuple[int, int, int]:
    missing = [k for k in ("height", "width") + (("frames",) if video else ()) if getattr(workload, k) is None]
    if missing:
        raise ValueError(f"{model_type}: workload.{missing[0]} is required for this DiT")
    return (workload.frames or 1), workload.height, workload.width


def dit_inputs(model: PlanModel, config: FrozenDict, workload: Workload) -> tuple[dict[str, Any], int]:
    """(forward kwargs, latent tokens after patchify) for ``model.type`` (wan, flux, qwenimage, sana, lumina2,
    ltx_video, auraflow, pixart_sigma)."""
    model_type, text = model.type, workload.text_tokens
    timestep = torch.full((1,), 500.0, dtype=torch.float32)
    spatial = model.vae_scale_factor_spatial
    if model_type == "wan":
        frames, height, width = _pixels(model_type, workload, video=True)
        temporal, spatial = model.vae_scale_factor_temporal or 4, spatial or 8
        latent = ((frames - 1) // temporal + 1, height // spatial, width // spatial)
        pt, ph, pw = config.patch_size
        tokens = (latent[0] // pt) * (latent[1] // ph) * (latent[2] // pw)
        return {
            "hidden_states": torch.zeros(1, config.in_channels, *latent),
            "timestep": timestep.expand(1, tokens) if model.expand_timesteps else timestep,
            "encoder_hidden_states": torch.zeros(1, text, config.text_dim),
            "return_dict": False,
        }, tokens
    if model_type == "ltx_video":
        frames, height, width = _pixels(model_type, workload, video=True)
        temporal, spatial = model.vae_scale_factor_temporal or 8, spatial or 32
        latent = ((frames - 1) // temporal + 1, height // spatial, width // spatial)
        p, pt = config.patch_size, config.patch_size_t
        tokens = (latent[0] // pt) * (latent[1] // p) * (latent[2] // p)
        return {
            "hidden_states": torch.zeros(1, tokens, config.in_channels),
            "encoder_hidden_states": torch.zeros(1, text, config.caption_channels),
            "timestep": timestep,
            "encoder_attention_mask": torch.ones(1, text, dtype=torch.bool),
            "num_frames": latent[0],
            "height": latent[1],
            "width": latent[2],
            "rope_interpolation_scale": (temporal / 25, spatial, spatial),
            "return_dict": False,
        }, tokens
    _, height, width = _pixels(model_type, workload, video=False)
    if model_type == "sana":
        spatial, patch = spatial or 32, config.patch_size
        rows, cols = height // spatial, width // spatial
        return {
            "hidden_states": torch.zeros(1, config.in_channels, rows, cols),
            "encoder_hidden_states": torch.zeros(1, text, config.caption_channels),
            "timestep": timestep,
            "return_dict": False,
        }, (rows // patch) * (cols // patch)
    if model_type == "lumina2":
        spatial, patch = spatial or 8, config.patch_size
        rows, cols = height // spatial, width // spatial
        with torch_compat.real_tensors():  # real even inside the fake mode: rope_embedder reads it (HOST_READS)
            mask = torch.ones(1, text, dtype=torch.long)
        return {
            "hidden_states": torch.zeros(1, config.in_channels, rows, cols),
            "timestep": timestep / 1000,
            "encoder_hidden_states": torch.zeros(1, text, config.cap_feat_dim),
            "encoder_attention_mask": mask,
            "return_dict": False,
        }, (rows // patch) * (cols // patch)
    if model_type == "auraflow":
        spatial, patch = spatial or 8, config.patch_size
        rows, cols = height // spatial, width // spatial
        return {
            "hidden_states": torch.zeros(1, config.in_channels, rows, cols),
            "encoder_hidden_states": torch.zeros(1, text, config.joint_attention_dim),
            "timestep": timestep / 1000,
            "return_dict": False,
        }, (rows // patch) * (cols // patch)
    if model_type == "pixart_sigma":
        spatial, patch = spatial or 8, config.patch_size
        rows, cols = height // spatial, width // spatial
        return {
            "hidden_states": torch.zeros(1, config.in_channels, rows, cols),
            "encoder_hidden_states": torch.zeros(1, text, config.caption_channels),
            "encoder_attention_mask": torch.ones(1, text, dtype=torch.long),
            "timestep": timestep,
            "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
            "return_dict": False,
        }, (rows // patch) * (cols // patch)
    rows, cols = height // 16, width // 16
    tokens = rows * cols
    if model_type == "flux":
        inputs = {
            "hidden_states": torch.zeros(1, tokens, config.in_channels),
            "encoder_hidden_states": torch.zeros(1, text, config.joint_attention_dim),
            "pooled_projections": torch.zeros(1, config.pooled_projection_dim),
            "timestep": timestep / 1000,
            "img_ids": torch.zeros(tokens, 3),
            "txt_ids": torch.zeros(text, 3),
            "return_dict": False,
        }
        if config.guidance_embeds:
            inputs["guidance"] = torch.full((1,), 3.5, dtype=torch.float32)
        return inputs, tokens
    if model_type == "qwenimage":
        return {
            "hidden_states": torch.zeros(1, tokens, config.in_channels),
            "encoder_hidden_states": torch.zeros(1, text, config.joint_attention_dim),
            "timestep": timestep / 1000,
            "img_shapes": [[(1, rows, cols)]],
            "return_dict": False,
        }, tokens
    raise ValueError(
        f"{model_type}: no plan inputs for this DiT (wan, flux, qwenimage, sana, lumina2, ltx_video, auraflow and "
        "pixart_sigma have them)"
    )
