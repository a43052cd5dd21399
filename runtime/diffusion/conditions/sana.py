"""Sana condition model: a Gemma2 text encoder (the pipeline's complex human instruction prepended, the first token
and the prompt's last ``max_sequence_length - 1`` tokens kept, with their attention mask, as
``SanaPipeline.encode_prompt`` selects them) and the DC-AE autoencoder (``AutoencoderDC``: a deterministic encoder,
latents ``z * scaling_factor``), loaded from a ``SanaPipeline`` directory.

Latents are unpacked ``(C, h, w)`` (the transformer patchifies, patch 1). Noise levels: logit-normal, shifted by the
scheduler's ``shift`` (Sana's ``flow_shift`` 3.0), the flow-matching recipe of diffusers' Sana training script
(``weighting_scheme = "logit_normal"``); the transformer's timestep is ``sigma * num_train_timesteps`` times the
config's ``timestep_scale`` (the pipeline's call).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any

import torch
from diffusers import SanaPipeline
from torch import Tensor

from runtime.diffusion.conditions.base import ConditionModel, stack_context
from runtime.diffusion.timesteps import TimestepSampler

__all__ = ["SanaConditionModel"]

TEXT_LENGTH = 300  # the pipeline's max_sequence_length
# the pipeline's default complex human instruction, prepended to every prompt
INSTRUCTION = inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default


class SanaConditionModel(ConditionModel):
    pipeline_class = SanaPipeline
    components = ("tokenizer", "text_encoder", "vae")
    pixel_multiple = 32  # SanaPipeline.check_inputs
    patch = (1, 1)
    # 32x64 px -> 4x8 latents (the tiny DC-AE downsamples x8) -> 4 grid rows of 8 tokens (patch 1)
    example_pixels = (3, 32, 64)
    pipeline_call = {"guidance_scale": 1.0, "use_resolution_binning": False}

    def __init__(self, pipeline: Any, sampler: TimestepSampler) -> None:
        super().__init__(pipeline, sampler)
        if self.has_encoders:
            self.scaling_factor = pipeline.vae.config.scaling_factor
        self.num_train_timesteps = pipeline.scheduler.config.num_train_timesteps

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, encoders: bool = True, **sampler_overrides: Any
    ) -> SanaConditionModel:
        pipeline = cls.load_pipeline(path, encoders=encoders)
        sampler = TimestepSampler.from_scheduler_config(
            pipeline.scheduler.config, **{"distribution": "logit_normal", **sampler_overrides}
        )
        return cls(pipeline, sampler)

    def encode_sample(self, pixels: Tensor) -> Tensor:
        """DC-AE latents (C, h, w) of one (C, H, W) image, ``z * scaling_factor`` (the encoder is deterministic)."""
        vae = self.pipeline.vae
        z = vae.encode(pixels[None].to(self.device, vae.dtype)).latent.float()
        return (z * self.scaling_factor)[0]

    def sampling_latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        scale = self.pipeline.vae_scale_factor
        return (self.pipeline.vae.config.latent_channels, height // scale, width // scale)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> list[dict[str, Tensor]]:
        embeds, mask, _, _ = self.pipeline.encode_prompt(
            list(prompts),
            do_classifier_free_guidance=False,
            device=self.device,
            max_sequence_length=TEXT_LENGTH,
            complex_human_instruction=INSTRUCTION,
        )
        return [
            {"encoder_hidden_states": e.float(), "encoder_attention_mask": m}
            for e, m in zip(embeds, mask, strict=True)
        ]

    def transformer_inputs(self, latents: Tensor, context: Sequence[dict[str, Tensor]], sigmas: Tensor) -> dict:
        scale = self.pipeline_timestep_scale
        return {
            "hidden_states": latents,
            "timestep": (sigmas * self.num_train_timesteps * scale).to(latents.device),
            "encoder_hidden_states": stack_context(context, "encoder_hidden_states").to(latents.device),
            "encoder_attention_mask": stack_context(context, "encoder_attention_mask").to(latents.device),
        }

    @property
    def pipeline_timestep_scale(self) -> float:
        transformer = getattr(self.pipeline, "transformer", None)
        return 1.0 if transformer is None else transformer.config.timestep_scale

    @torch.no_grad()
    def decode_latents(self, latents: Tensor) -> Tensor:
        vae = self.pipeline.vae
        x = latents.to(self.device, torch.float32) / self.scaling_factor
        return vae.decode(x.to(vae.dtype), return_dict=False)[0].float().clamp(-1, 1)

    @classmethod
    def tiny_components(cls, config: dict[str, Any], variant: str | None) -> dict[str, Any]:
        from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler
        from transformers import Gemma2Config, Gemma2Model

        from runtime.diffusion.tiny_pipelines import tiny_tokenizer

        tokenizer = tiny_tokenizer()
        text_encoder = Gemma2Model(
            Gemma2Config(
                vocab_size=len(tokenizer),
                hidden_size=config["caption_channels"],
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
                max_position_embeddings=8192,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        vae = AutoencoderDC(  # 4 blocks: x8 downsampling (the pipeline's vae_scale_factor)
            in_channels=3,
            latent_channels=config["in_channels"],
            encoder_block_types="ResBlock",
            decoder_block_types="ResBlock",
            encoder_block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8),
            encoder_layers_per_block=(1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1),
            encoder_qkv_multiscales=((), (), (), ()),
            decoder_qkv_multiscales=((), (), (), ()),
            scaling_factor=0.41407,
        )
        return dict(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        )
