"""Flux.1 condition model: CLIP (pooled) + T5 text encoders and AutoencoderKL, loaded from a ``FluxPipeline``
directory.

Latents are the VAE posterior's mode, ``(z - shift_factor) * scaling_factor``, kept unpacked per sample; training
inputs pack them 2x2 into tokens with the pipeline's ``_pack_latents`` / ``_prepare_latent_image_ids``, the text
ids are zeros as in the pipeline, and guidance-distilled checkpoints (``guidance_embeds``) get a constant guidance
(``guidance_scale``, 3.5 by default as in diffusers' Flux training scripts). Noise levels: logit-normal, shifted
by the resolution-dependent ``mu`` of the scheduler's dynamic-shifting settings; the transformer's timestep is
sigma (the pipeline passes ``t / 1000``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import FluxPipeline
from torch import Tensor

from runtime.diffusion.conditions.base import ConditionModel, resolution_shift, stack_context
from runtime.diffusion.timesteps import TimestepSampler

__all__ = ["FluxConditionModel"]

TEXT_LENGTH = 512  # FluxPipeline's max_sequence_length (T5 tokens)


class FluxConditionModel(ConditionModel):
    pipeline_class = FluxPipeline
    components = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2", "vae")
    # 32x48 px -> 4x6 latents -> 2x3 packed tokens
    example_pixels = (3, 32, 48)
    pipeline_call = {"guidance_scale": 3.5}

    @classmethod
    def tiny_components(cls, config: dict[str, Any], variant: str | None) -> dict[str, Any]:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

        from runtime.diffusion.tiny_pipelines import tiny_clip_text, tiny_t5, tiny_tokenizer

        tokenizer, tokenizer_2 = tiny_tokenizer(model_max_length=77), tiny_tokenizer()
        return dict(
            tokenizer=tokenizer,
            tokenizer_2=tokenizer_2,
            text_encoder=tiny_clip_text(tokenizer, config["pooled_projection_dim"]),
            text_encoder_2=tiny_t5(tokenizer_2, config["joint_attention_dim"]),
            vae=AutoencoderKL(  # 4 blocks: the x8 scale factor FluxPipeline derives from block_out_channels
                block_out_channels=[8, 8, 8, 8],
                down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4,
                latent_channels=config["in_channels"] // 4,
                layers_per_block=1,
                norm_num_groups=4,
                shift_factor=0.1159,
                scaling_factor=0.3611,
            ),
            scheduler=FlowMatchEulerDiscreteScheduler(
                use_dynamic_shifting=True,
                base_shift=0.5,
                max_shift=1.15,
                base_image_seq_len=256,
                max_image_seq_len=4096,
            ),
        )

    def __init__(self, pipeline: Any, sampler: TimestepSampler, guidance_scale: float | None) -> None:
        super().__init__(pipeline, sampler)
        self.guidance_scale = guidance_scale
        if self.has_encoders:
            self.shift_factor = pipeline.vae.config.shift_factor or 0.0
            self.scaling_factor = pipeline.vae.config.scaling_factor

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, guidance_scale: float = 3.5, encoders: bool = True, **sampler_overrides: Any
    ) -> FluxConditionModel:
        pipeline = cls.load_pipeline(path, encoders=encoders)
        transformer_config = json.loads((Path(path) / "transformer" / "config.json").read_text())
        sampler = TimestepSampler.from_scheduler_config(
            pipeline.scheduler.config, **{"distribution": "logit_normal", **sampler_overrides}
        )
        return cls(pipeline, sampler, guidance_scale if transformer_config.get("guidance_embeds") else None)

    def encode_sample(self, pixels: Tensor) -> Tensor:
        """Normalized VAE latents (C, h, w) of one (C, H, W) image: ``(z - shift_factor) * scaling_factor``."""
        return ((self.vae_mode(pixels) - self.shift_factor) * self.scaling_factor)[0]

    # ---- sampling (FluxPipeline.__call__) --------------------------------------------------------------------------

    def sampling_latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        scale = self.pipeline.vae_scale_factor
        return (self.pipeline.vae.config.latent_channels, height // scale, width // scale)

    def sampling_schedule(self, num_inference_steps: int, latent_shape: Sequence[int]) -> dict[str, Any]:
        """``linspace(1, 1 / N, N)`` shifted by ``mu`` of the packed token count, as the pipeline does."""
        config = self.pipeline.scheduler.config
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        if config.get("use_flow_sigmas"):
            sigmas = None
        return {"sigmas": None if sigmas is None else sigmas.tolist(), "mu": resolution_shift(config, latent_shape)}

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> list[dict[str, Tensor]]:
        prompt_embeds, pooled, _ = self.pipeline.encode_prompt(
            list(prompts), prompt_2=None, device=self.device, max_sequence_length=TEXT_LENGTH
        )
        return [
            {"encoder_hidden_states": e.float(), "pooled_projections": p.float()}
            for e, p in zip(prompt_embeds, pooled, strict=True)
        ]

    def transformer_inputs(self, latents: Tensor, context: Sequence[dict[str, Tensor]], sigmas: Tensor) -> dict:
        b, c, h, w = latents.shape
        device = latents.device
        text = stack_context(context, "encoder_hidden_states").to(device)
        inputs: dict[str, Any] = {
            "hidden_states": FluxPipeline._pack_latents(latents, b, c, h, w),
            "encoder_hidden_states": text,
            "pooled_projections": stack_context(context, "pooled_projections").to(device),
            "timestep": sigmas.to(device),
            "img_ids": FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, text.dtype),
            "txt_ids": torch.zeros(text.shape[1], 3, device=device, dtype=text.dtype),
        }
        if self.guidance_scale is not None:
            inputs["guidance"] = torch.full((b,), self.guidance_scale, device=device)
        return inputs

    def prediction_to_latents(self, prediction: Tensor, latent_shape: Sequence[int]) -> Tensor:
        scale = self.pipeline.vae_scale_factor
        h, w = latent_shape[-2:]
        return FluxPipeline._unpack_latents(prediction, h * scale, w * scale, scale)

    def latents_to_prediction(self, latents: Tensor) -> Tensor:
        return FluxPipeline._pack_latents(latents, *latents.shape)

    @torch.no_grad()
    def decode_latents(self, latents: Tensor) -> Tensor:
        vae = self.pipeline.vae
        x = latents.to(self.device, torch.float32) / self.scaling_factor + self.shift_factor
        return vae.decode(x.to(vae.dtype), return_dict=False)[0].float().clamp(-1, 1)
