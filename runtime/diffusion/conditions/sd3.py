"""Stable Diffusion 3 / 3.5 condition model: two CLIP text encoders (pooled + hidden states) and T5, concatenated
along the sequence as the pipeline does (CLIP states padded to the T5 width, then the T5 tokens), and AutoencoderKL,
loaded from a ``StableDiffusion3Pipeline`` directory.

Latents are the VAE posterior's mode, ``(z - shift_factor) * scaling_factor``, unpacked ``(C, h, w)``: the
transformer patchifies itself. Noise levels: logit-normal, shifted by the scheduler's ``shift`` (3.0 in the released
pipelines), as diffusers' SD3 training scripts draw them (``weighting_scheme = "logit_normal"``, no loss weighting);
the transformer's timestep is ``sigma * num_train_timesteps``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from diffusers import StableDiffusion3Pipeline
from torch import Tensor

from runtime.diffusion.conditions.base import ConditionModel, resolution_shift, stack_context
from runtime.diffusion.timesteps import TimestepSampler

__all__ = ["SD3ConditionModel"]

TEXT_LENGTH = 256  # the pipeline's max_sequence_length (T5 tokens), after 77 CLIP tokens


class SD3ConditionModel(ConditionModel):
    pipeline_class = StableDiffusion3Pipeline
    components = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2", "tokenizer_3", "text_encoder_3", "vae")
    # 32x48 px -> 4x6 latents -> 2x3 tokens (patch 2)
    example_pixels = (3, 32, 48)
    pipeline_call = {"guidance_scale": 1.0}

    def __init__(self, pipeline: Any, sampler: TimestepSampler) -> None:
        super().__init__(pipeline, sampler)
        if self.has_encoders:
            self.shift_factor = pipeline.vae.config.shift_factor or 0.0
            self.scaling_factor = pipeline.vae.config.scaling_factor
        self.num_train_timesteps = pipeline.scheduler.config.num_train_timesteps

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, encoders: bool = True, **sampler_overrides: Any
    ) -> SD3ConditionModel:
        pipeline = cls.load_pipeline(path, encoders=encoders)
        sampler = TimestepSampler.from_scheduler_config(
            pipeline.scheduler.config, **{"distribution": "logit_normal", **sampler_overrides}
        )
        return cls(pipeline, sampler)

    def encode_sample(self, pixels: Tensor) -> Tensor:
        """Normalized VAE latents (C, h, w) of one (C, H, W) image: ``(z - shift_factor) * scaling_factor``."""
        return ((self.vae_mode(pixels) - self.shift_factor) * self.scaling_factor)[0]

    # ---- sampling (StableDiffusion3Pipeline.__call__) ---------------------------------------------------------------

    def sampling_latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        scale = self.pipeline.vae_scale_factor
        return (self.pipeline.vae.config.latent_channels, height // scale, width // scale)

    def sampling_schedule(self, num_inference_steps: int, latent_shape: Sequence[int]) -> dict[str, Any]:
        """The scheduler's grid (its ``shift``); with dynamic shifting, ``mu`` of the 2x2-patch token count as the
        pipeline computes it (every released SD3 transformer has patch size 2)."""
        config = self.pipeline.scheduler.config
        if not config.get("use_dynamic_shifting"):
            return {}
        return {"mu": resolution_shift(config, latent_shape, max_shift=1.16)}

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> list[dict[str, Tensor]]:
        prompts = list(prompts)
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompts,
            prompts,
            prompts,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=TEXT_LENGTH,
        )
        return [
            {"encoder_hidden_states": e.float(), "pooled_projections": p.float()}
            for e, p in zip(embeds, pooled, strict=True)
        ]

    def transformer_inputs(self, latents: Tensor, context: Sequence[dict[str, Tensor]], sigmas: Tensor) -> dict:
        return {
            "hidden_states": latents,
            "timestep": (sigmas * self.num_train_timesteps).to(latents.device),
            "encoder_hidden_states": stack_context(context, "encoder_hidden_states").to(latents.device),
            "pooled_projections": stack_context(context, "pooled_projections").to(latents.device),
        }

    @torch.no_grad()
    def decode_latents(self, latents: Tensor) -> Tensor:
        vae = self.pipeline.vae
        x = latents.to(self.device, torch.float32) / self.scaling_factor + self.shift_factor
        return vae.decode(x.to(vae.dtype), return_dict=False)[0].float().clamp(-1, 1)

    @classmethod
    def tiny_components(cls, config: dict[str, Any], variant: str | None) -> dict[str, Any]:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
        from transformers import CLIPTextConfig, CLIPTextModelWithProjection

        from runtime.diffusion.tiny_pipelines import tiny_t5, tiny_tokenizer

        clip_width = config["pooled_projection_dim"] // 2  # the two CLIP projections are concatenated

        def clip(tokenizer: Any) -> Any:
            return CLIPTextModelWithProjection(
                CLIPTextConfig(
                    vocab_size=len(tokenizer),
                    hidden_size=clip_width,
                    projection_dim=clip_width,
                    intermediate_size=32,
                    num_hidden_layers=2,  # the pipeline reads the penultimate hidden state
                    num_attention_heads=4,
                    max_position_embeddings=77,
                    bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            )

        tokenizer, tokenizer_2 = tiny_tokenizer(model_max_length=77), tiny_tokenizer(model_max_length=77)
        tokenizer_3 = tiny_tokenizer()
        return dict(
            tokenizer=tokenizer,
            text_encoder=clip(tokenizer),
            tokenizer_2=tokenizer_2,
            text_encoder_2=clip(tokenizer_2),
            tokenizer_3=tokenizer_3,
            text_encoder_3=tiny_t5(tokenizer_3, config["joint_attention_dim"]),
            vae=AutoencoderKL(  # 4 blocks: the x8 scale factor the pipeline derives from block_out_channels
                block_out_channels=[8, 8, 8, 8],
                down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4,
                latent_channels=config["in_channels"],
                layers_per_block=1,
                norm_num_groups=4,
                shift_factor=0.0609,
                scaling_factor=1.5305,
            ),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        )
