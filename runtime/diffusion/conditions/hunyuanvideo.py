"""HunyuanVideo condition model: a Llama-style text encoder (the pipeline's prompt template, its first
``crop_start`` tokens dropped, a hidden state two layers below the top), CLIP's pooled text embedding and
AutoencoderKLHunyuanVideo, loaded from a ``HunyuanVideoPipeline`` directory.

Latents are the VAE posterior's mode times the VAE's ``scaling_factor`` (the pipeline divides by it before
decoding). Text embeddings keep the pipeline's fixed length (``max_sequence_length`` tokens after the template) with
its attention mask. Guidance-distilled checkpoints take a guidance embedding; training feeds a constant
``guidance_scale`` (1.0 by default, as finetrainers' HunyuanVideo recipe; the pipeline multiplies it by 1000 as
here). Noise levels: uniform, shifted by the scheduler's ``shift`` (7.0 in the released pipeline); the transformer's
timestep is ``sigma * num_train_timesteps``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import HunyuanVideoPipeline
from torch import Tensor

from runtime.diffusion.conditions.base import ConditionModel, stack_context
from runtime.diffusion.timesteps import TimestepSampler

__all__ = ["HunyuanVideoConditionModel"]

TEXT_LENGTH = 256  # HunyuanVideoPipeline's max_sequence_length (tokens after the prompt template)


class HunyuanVideoConditionModel(ConditionModel):
    pipeline_class = HunyuanVideoPipeline
    components = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2", "vae")
    video = True
    temporal_multiple = 4  # AutoencoderKLHunyuanVideo: the first frame, then 4 frames per latent frame
    patch = (1, 2, 2)
    # 5 frames -> 2 latent frames; 32 px -> 4x4 latents -> 2x2 tokens per frame (patch 2)
    example_pixels = (3, 5, 32, 32)
    pipeline_call = {"num_frames": 5, "guidance_scale": 1.0}  # the training default: what the trainer feeds

    def __init__(self, pipeline: Any, sampler: TimestepSampler, guidance_scale: float | None) -> None:
        super().__init__(pipeline, sampler)
        self.guidance_scale = guidance_scale
        self.num_train_timesteps = pipeline.scheduler.config.num_train_timesteps

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, guidance_scale: float = 1.0, encoders: bool = True, **sampler_overrides: Any
    ) -> HunyuanVideoConditionModel:
        pipeline = cls.load_pipeline(path, encoders=encoders)
        sampler = TimestepSampler.from_scheduler_config(pipeline.scheduler.config, **sampler_overrides)
        # the transformer is never loaded here: whether it embeds guidance comes from its config file
        config = json.loads((Path(path) / "transformer" / "config.json").read_text())
        return cls(pipeline, sampler, guidance_scale if config.get("guidance_embeds", True) else None)

    def encode_sample(self, pixels: Tensor) -> Tensor:
        """Scaled VAE latents of one (C, F, H, W) video (the posterior's mode times ``scaling_factor``)."""
        return (self.vae_mode(pixels) * self.pipeline.vae.config.scaling_factor)[0]

    # ---- sampling (HunyuanVideoPipeline.__call__) ------------------------------------------------------------------

    def sampling_latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        pipe = self.pipeline
        latent_frames = ((frames or 1) - 1) // pipe.vae_scale_factor_temporal + 1
        spatial = pipe.vae_scale_factor_spatial
        return (pipe.vae.config.latent_channels, latent_frames, height // spatial, width // spatial)

    def sampling_schedule(self, num_inference_steps: int, latent_shape: Sequence[int]) -> dict[str, Any]:
        """The pipeline's ``sigmas = linspace(1, 0, N + 1)[:-1]``, shifted by the scheduler's ``shift``."""
        return {"sigmas": np.linspace(1.0, 0.0, num_inference_steps + 1)[:-1].tolist()}

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> list[dict[str, Tensor]]:
        embeds, pooled, mask = self.pipeline.encode_prompt(
            list(prompts), device=self.device, dtype=torch.float32, max_sequence_length=TEXT_LENGTH
        )
        return [
            {"encoder_hidden_states": e.float(), "encoder_attention_mask": m, "pooled_projections": p.float()}
            for e, m, p in zip(embeds, mask, pooled, strict=True)
        ]

    def transformer_inputs(self, latents: Tensor, context: Sequence[dict[str, Tensor]], sigmas: Tensor) -> dict:
        device = latents.device
        inputs: dict[str, Any] = {
            "hidden_states": latents,
            "timestep": (sigmas * self.num_train_timesteps).to(device),
            "encoder_hidden_states": stack_context(context, "encoder_hidden_states").to(device),
            "encoder_attention_mask": stack_context(context, "encoder_attention_mask").to(device),
            "pooled_projections": stack_context(context, "pooled_projections").to(device),
        }
        if self.guidance_scale is not None:
            inputs["guidance"] = torch.full((latents.shape[0],), self.guidance_scale * 1000.0, device=device)
        return inputs

    @torch.no_grad()
    def decode_latents(self, latents: Tensor) -> Tensor:
        vae = self.pipeline.vae
        x = latents.to(self.device, vae.dtype) / vae.config.scaling_factor
        return vae.decode(x, return_dict=False)[0].float().clamp(-1, 1)

    @classmethod
    def tiny_components(cls, config: dict[str, Any], variant: str | None) -> dict[str, Any]:
        from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler
        from transformers import LlamaConfig, LlamaModel

        from runtime.diffusion.tiny_pipelines import tiny_clip_text, tiny_tokenizer

        tokenizer, tokenizer_2 = tiny_tokenizer(), tiny_tokenizer(model_max_length=77)
        llama = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=config["text_embed_dim"],
            intermediate_size=32,
            num_hidden_layers=3,  # the pipeline reads the hidden state two layers below the top
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            pad_token_id=tokenizer.pad_token_id,
        )
        return dict(
            tokenizer=tokenizer,
            text_encoder=LlamaModel(llama),
            tokenizer_2=tokenizer_2,
            text_encoder_2=tiny_clip_text(tokenizer_2, config["pooled_projection_dim"]),
            vae=AutoencoderKLHunyuanVideo(  # x8 spatial, x4 temporal: the scale factors the pipeline assumes
                latent_channels=config["in_channels"],
                block_out_channels=(8, 8, 8, 8),
                layers_per_block=1,
                norm_num_groups=4,
            ),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        )
