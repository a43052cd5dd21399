"""LTX-Video condition model: a T5 text encoder (128 tokens padded on the right, with its attention mask) and
``AutoencoderKLLTXVideo`` (32x spatial, 8x temporal compression), loaded from an ``LTXPipeline`` directory.

Latents are the VAE posterior's mode normalised per channel as the pipeline does (``_normalize_latents``:
``(z - latents_mean) * scaling_factor / latents_std``, the VAE's ``latents_mean`` / ``latents_std`` buffers), kept
unpacked per sample ``(C, F, h, w)``; the transformer takes them packed into tokens by the pipeline's
``_pack_latents`` with the transformer's patch sizes (1 and 1 in the released models) and is told the latent grid
(``num_frames``, ``height``, ``width``) and ``rope_interpolation_scale = (temporal ratio / frame_rate, spatial
ratio, spatial ratio)`` (the VAE's compression ratios; ``frame_rate`` 25, the pipeline's default), as
``LTXPipeline.__call__`` passes them. The timestep is ``1000 sigma`` per sample (the scheduler's ``t``, which the
pipeline passes), the prediction the flow velocity ``noise - x0``.

Sampling (``LTXPipeline.__call__``): ``linspace(1, 1 / N, N)`` shifted by ``mu`` of the latent token count
``F h w`` with the scheduler's dynamic-shifting settings (LTX-Video's: base 1024 / 0.95, max 4096 / 2.05, and a
``shift_terminal``, which the scheduler applies itself); true CFG with the negative prompt encoded like a prompt
(``""`` by default), ``uncond + s (cond - uncond)`` (the pipeline's ``guidance_scale``, default 3.0; its
``guidance_rescale`` defaults to 0 and is not reproduced). Decoding denormalises and, for a VAE with
``timestep_conditioning`` (0.9.1 and later), passes the pipeline's ``decode_timestep`` (0.0 by default; options
``decode_timestep`` / ``decode_noise_scale``, as the pipeline's).

Training noise levels: finetrainers' LTX-Video recipe (``finetrainers/models/ltx_video``, its trainer's
``prepare_sigmas``): a **logit-normal** draw (the flow weighting its LTX example runs, ``logit_normal``, mean 0,
std 1) over the **unshifted** grid of a default ``FlowMatchEulerDiscreteScheduler()`` (no resolution shift at
training time, although the pipeline samples with one), loss weight 1. Two differences, both on purpose:
finetrainers truncates the timestep to an integer (``(1000 sigma).long()``) and passes it per token
(``(b, L, 1)``, every token the same level); here it is the pipeline's float ``1000 sigma`` per sample, what the
transformer is given at inference (its embedding of a constant per-token timestep is the per-sample one). Its 10 %
first-frame conditioning (a less-noised first frame) belongs to image-to-video training, which this model does not
do (``LTXPipeline`` only). ``dit.condition`` overrides the sampler (``distribution``, ``shift``, ``dynamic``, ...).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import LTXPipeline
from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift
from torch import Tensor

from runtime.diffusion.conditions.base import ConditionModel, stack_context
from runtime.diffusion.timesteps import TimestepSampler

__all__ = ["FRAME_RATE", "LTXVideoConditionModel", "TEXT_LENGTH", "vae_compression"]

TEXT_LENGTH = 128  # LTXPipeline's max_sequence_length (T5 tokens)
FRAME_RATE = 25  # LTXPipeline's default frame_rate (its rope_interpolation_scale's temporal part)


def vae_compression(config: Mapping[str, Any]) -> tuple[int, int]:
    """(spatial, temporal) compression of an ``AutoencoderKLLTXVideo`` config, computed as its ``__init__`` does
    (the explicit ratios, else ``patch_size * 2 ** sum(spatio_temporal_scaling)``), so a pipeline loaded without
    its VAE (``encoders=False``: a trainer reading cached conditions) still knows its ``rope_interpolation_scale``."""
    scaling = 2 ** sum(bool(s) for s in config.get("spatio_temporal_scaling", (True, True, True, False)))
    spatial = config.get("spatial_compression_ratio") or config.get("patch_size", 4) * scaling
    temporal = config.get("temporal_compression_ratio") or config.get("patch_size_t", 1) * scaling
    return int(spatial), int(temporal)


class LTXVideoConditionModel(ConditionModel):
    pipeline_class = LTXPipeline
    components = ("tokenizer", "text_encoder", "vae")
    video = True
    pixel_multiple = 32  # LTXPipeline.check_inputs: height and width divisible by 32 (the VAE's spatial ratio)
    temporal_multiple = 8  # the causal VAE: the first frame, then 8 frames per latent frame
    patch = (1, 1, 1)  # the released transformers' (patch_size_t, patch_size, patch_size); read from the directory
    # 9 frames -> 2 latent frames; 64x96 px -> 2x3 latents: 12 tokens
    example_pixels = (3, 9, 64, 96)
    # one conditional call per step: under CFG (the pipeline's default 3.0) LTXPipeline batches [negative; prompt]
    # into one call, so its first row would be the negative prompt; CFG is tested in tests/conditions/test_ltx_video.py
    pipeline_call = {"num_frames": 9, "guidance_scale": 1.0}

    def __init__(
        self,
        pipeline: Any,
        sampler: TimestepSampler,
        patch: tuple[int, int, int] = (1, 1, 1),
        compression: tuple[int, int] | None = None,
        latent_channels: int | None = None,
        frame_rate: float = FRAME_RATE,
        decode_timestep: float = 0.0,
        decode_noise_scale: float | None = None,
    ) -> None:
        super().__init__(pipeline, sampler)
        self.patch = tuple(patch)
        spatial, temporal = compression or (
            pipeline.vae_spatial_compression_ratio,
            pipeline.vae_temporal_compression_ratio,
        )
        self.spatial_ratio, self.temporal_ratio = int(spatial), int(temporal)
        vae = getattr(pipeline, "vae", None)
        self.latent_channels = int(latent_channels or vae.config.latent_channels)
        self.frame_rate = frame_rate
        # LTXPipeline.__call__'s micro-condition, a tuple of floats as the pipeline passes it
        self.rope_interpolation_scale = (self.temporal_ratio / frame_rate, self.spatial_ratio, self.spatial_ratio)
        self.decode_timestep = decode_timestep
        self.decode_noise_scale = decode_timestep if decode_noise_scale is None else decode_noise_scale
        self.num_train_timesteps = pipeline.scheduler.config.num_train_timesteps

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        encoders: bool = True,
        frame_rate: float = FRAME_RATE,
        decode_timestep: float = 0.0,
        decode_noise_scale: float | None = None,
        **sampler_overrides: Any,
    ) -> LTXVideoConditionModel:
        """``frame_rate``: the videos' (the pipeline's ``frame_rate``, 25 by default), which scales the RoPE's time
        axis; ``decode_*``: the pipeline's decoding options (rewards); ``sampler_overrides``: the noise levels
        (module doc)."""
        pipeline = cls.load_pipeline(path, encoders=encoders)
        transformer = json.loads((Path(path) / "transformer" / "config.json").read_text())
        vae = json.loads((Path(path) / "vae" / "config.json").read_text())
        return cls(
            pipeline,
            cls.training_sampler(pipeline.scheduler.config, **sampler_overrides),
            patch=(
                transformer.get("patch_size_t", 1),
                transformer.get("patch_size", 1),
                transformer.get("patch_size", 1),
            ),
            compression=vae_compression(vae),
            latent_channels=vae.get("latent_channels", 128),
            frame_rate=frame_rate,
            decode_timestep=decode_timestep,
            decode_noise_scale=decode_noise_scale,
        )

    @staticmethod
    def training_sampler(config: Any, **overrides: Any) -> TimestepSampler:
        """finetrainers' LTX-Video levels (module doc): logit-normal, unshifted (no static or resolution shift,
        whatever the pipeline's scheduler samples with), unweighted."""
        defaults = {"distribution": "logit_normal", "dynamic": False, "shift": 1.0, "weighting": "none"}
        return TimestepSampler.from_scheduler_config(config, **{**defaults, **overrides})

    def encode_sample(self, pixels: Tensor) -> Tensor:
        """Normalized latents ``(C, F, h, w)`` of one ``(C, F, H, W)`` video: the pipeline's ``_normalize_latents``
        with the VAE's ``latents_mean`` / ``latents_std`` buffers and ``scaling_factor``."""
        vae = self.pipeline.vae
        z = self.vae_mode(pixels)
        return LTXPipeline._normalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)[0]

    # ---- sampling (LTXPipeline.__call__) ---------------------------------------------------------------------------

    def sampling_latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """``prepare_latents``: one latent frame for the first frame and one per ``temporal_ratio`` after it."""
        frames = 1 if frames is None else frames
        return (
            self.latent_channels,
            (frames - 1) // self.temporal_ratio + 1,
            height // self.spatial_ratio,
            width // self.spatial_ratio,
        )

    def sampling_schedule(self, num_inference_steps: int, latent_shape: Sequence[int]) -> dict[str, Any]:
        """``linspace(1, 1 / N, N)`` and ``mu`` of the latent token count ``F h w`` (the pipeline's
        ``video_sequence_length``, before the transformer's patch)."""
        config = self.pipeline.scheduler.config
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        frames, height, width = latent_shape[-3:]
        mu = calculate_shift(
            frames * height * width,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        return {"sigmas": sigmas.tolist(), "mu": mu}

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> list[dict[str, Tensor]]:
        """``encode_prompt``'s T5 states and boolean mask (128 tokens), as the pipeline feeds them."""
        embeds, mask, _, _ = self.pipeline.encode_prompt(
            list(prompts), do_classifier_free_guidance=False, max_sequence_length=TEXT_LENGTH, device=self.device
        )
        return [
            {"encoder_hidden_states": e.float(), "encoder_attention_mask": m}
            for e, m in zip(embeds, mask, strict=True)
        ]

    def transformer_inputs(self, latents: Tensor, context: Sequence[dict[str, Tensor]], sigmas: Tensor) -> dict:
        """Packed latents, ``timestep = 1000 sigma`` per sample (the scheduler's ``t`` the pipeline passes), the
        text and its mask, the latent grid and ``rope_interpolation_scale`` as ``LTXPipeline.__call__`` passes them."""
        _, _, frames, height, width = latents.shape
        device = latents.device
        patch_t, patch = self.patch[0], self.patch[1]
        return {
            "hidden_states": LTXPipeline._pack_latents(latents, patch, patch_t),
            "encoder_hidden_states": stack_context(context, "encoder_hidden_states").to(device),
            "timestep": (sigmas * self.num_train_timesteps).to(device),
            "encoder_attention_mask": stack_context(context, "encoder_attention_mask").to(device),
            "num_frames": frames,
            "height": height,
            "width": width,
            "rope_interpolation_scale": self.rope_interpolation_scale,
        }

    def prediction_to_latents(self, prediction: Tensor, latent_shape: Sequence[int]) -> Tensor:
        """The pipeline's ``_unpack_latents`` of the transformer's tokens."""
        frames, height, width = latent_shape[-3:]
        patch_t, patch = self.patch[0], self.patch[1]
        return LTXPipeline._unpack_latents(
            prediction, frames // patch_t, height // patch, width // patch, patch, patch_t
        )

    def latents_to_prediction(self, latents: Tensor) -> Tensor:
        """The training target packed like the transformer's output."""
        return LTXPipeline._pack_latents(latents, self.patch[1], self.patch[0])

    @torch.no_grad()
    def decode_latents(self, latents: Tensor) -> Tensor:
        """Pixels ``(B, 3, F, H, W)`` in [-1, 1]: ``_denormalize_latents``, then the VAE (with the decode timestep
        and its noise, as the pipeline, when the VAE is timestep-conditioned)."""
        vae = self.pipeline.vae
        x = latents.to(self.device, torch.float32)
        x = LTXPipeline._denormalize_latents(x, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        timestep = None
        if vae.config.timestep_conditioning:
            timestep = torch.full((x.shape[0],), float(self.decode_timestep), device=x.device)
            if self.decode_noise_scale:
                x = (1 - self.decode_noise_scale) * x + self.decode_noise_scale * torch.randn_like(x)
        return vae.decode(x.to(vae.dtype), timestep, return_dict=False)[0].float().clamp(-1, 1)

    @classmethod
    def tiny_components(cls, config: dict[str, Any], variant: str | None) -> dict[str, Any]:
        """A one-layer T5 of width ``caption_channels``; an ``AutoencoderKLLTXVideo`` with the released compression
        (patch 4 and three spatio-temporal downsamplings: 32x, 8x) and ``in_channels`` latent channels (patch 1),
        non-trivial ``latents_mean`` / ``latents_std`` and ``scaling_factor`` so the normalisation is exercised; a
        flow-matching scheduler with LTX-Video's dynamic-shifting settings and ``shift_terminal``."""
        from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler

        from runtime.diffusion.tiny_pipelines import tiny_t5, tiny_tokenizer

        channels = config["in_channels"] // (config.get("patch_size", 1) ** 2 * config.get("patch_size_t", 1))
        tokenizer = tiny_tokenizer()
        vae = AutoencoderKLLTXVideo(
            latent_channels=channels,
            block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1),
            scaling_factor=1.5,
        )
        with torch.no_grad():
            vae.latents_mean.copy_(torch.linspace(-0.3, 0.3, channels))
            vae.latents_std.copy_(torch.linspace(0.5, 2.0, channels))
        return dict(
            tokenizer=tokenizer,
            text_encoder=tiny_t5(tokenizer, config["caption_channels"]),
            vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(
                use_dynamic_shifting=True,
                base_shift=0.95,
                max_shift=2.05,
                base_image_seq_len=1024,
                max_image_seq_len=4096,
                shift_terminal=0.1,
            ),
        )
