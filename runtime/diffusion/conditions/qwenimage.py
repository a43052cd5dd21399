"""Qwen-Image condition model: Qwen2.5-VL text encoder (the pipeline's prompt template, its first tokens dropped)
and AutoencoderKLQwenImage, loaded from a ``QwenImagePipeline`` directory.

Latents are the VAE posterior's mode of the image as a one-frame video, normalized with the VAE config's
per-channel ``latents_mean`` / ``latents_std``, kept unpacked per sample; training inputs pack them 2x2 with the
pipeline's ``_pack_latents`` and give ``img_shapes`` as the pipeline does. Prompts keep their own length per
sample; a batch pads them and passes ``encoder_hidden_states_mask`` (None when no sample is padded, as the
pipeline). Noise levels: uniform, shifted by the resolution-dependent ``mu`` of the scheduler's dynamic-shifting
settings; the transformer's timestep is sigma (the pipeline passes ``t / 1000``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from diffusers import QwenImagePipeline
from torch import Tensor

from runtime.diffusion.conditions.base import ConditionModel, resolution_shift
from runtime.diffusion.timesteps import TimestepSampler

__all__ = ["QwenImageConditionModel"]


class QwenImageConditionModel(ConditionModel):
    pipeline_class = QwenImagePipeline
    components = ("tokenizer", "text_encoder", "vae")
    # 32x48 px -> 4x6 latents -> 2x3 packed tokens
    example_pixels = (3, 32, 48)
    pipeline_call = {"true_cfg_scale": 1.0}

    @classmethod
    def tiny_components(cls, config: dict[str, Any], variant: str | None) -> dict[str, Any]:
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
        from transformers import Qwen2_5_VLForConditionalGeneration

        from runtime.diffusion.tiny_pipelines import tiny_tokenizer
        from runtime.models.tiny_configs import tiny_config as tiny_transformers_config

        tokenizer = tiny_tokenizer()
        text_config = tiny_transformers_config("qwen2_5_vl", text_config={"vocab_size": len(tokenizer)})
        if text_config.get_text_config().hidden_size != config["joint_attention_dim"]:
            raise ValueError("specs/qwenimage.toml: joint_attention_dim must be the tiny qwen2_5_vl text hidden size")
        return dict(
            tokenizer=tokenizer,
            text_encoder=Qwen2_5_VLForConditionalGeneration(text_config),
            vae=AutoencoderKLQwenImage(  # 3 temporal-downsample entries: the x8 scale factor the pipeline derives
                base_dim=8,
                z_dim=config["out_channels"],
                dim_mult=[1, 1, 1, 1],
                num_res_blocks=1,
                temperal_downsample=[False, True, True],
                latents_mean=[0.1, -0.2, 0.3, -0.1],
                latents_std=[1.5, 0.8, 1.2, 2.0],
            ),
            scheduler=FlowMatchEulerDiscreteScheduler(
                use_dynamic_shifting=True,
                base_shift=0.5,
                max_shift=0.9,
                base_image_seq_len=256,
                max_image_seq_len=8192,
                time_shift_type="exponential",
            ),
        )

    def __init__(self, pipeline: Any, sampler: TimestepSampler) -> None:
        super().__init__(pipeline, sampler)
        if self.has_encoders:
            vae = pipeline.vae.config
            mean, std = torch.tensor(vae.latents_mean), torch.tensor(vae.latents_std)
            self.register_buffer("latents_mean", mean.view(1, -1, 1, 1, 1), persistent=False)
            self.register_buffer("latents_std", std.view(1, -1, 1, 1, 1), persistent=False)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, encoders: bool = True, **sampler_overrides: Any
    ) -> QwenImageConditionModel:
        pipeline = cls.load_pipeline(path, encoders=encoders)
        return cls(pipeline, TimestepSampler.from_scheduler_config(pipeline.scheduler.config, **sampler_overrides))

    def encode_sample(self, pixels: Tensor) -> Tensor:
        """Normalized VAE latents (C, h, w) of one (C, H, W) image (a one-frame video to its video VAE)."""
        return ((self.vae_mode(pixels[:, None]) - self.latents_mean) / self.latents_std)[0, :, 0]

    # ---- sampling (QwenImagePipeline.__call__) ---------------------------------------------------------------------

    def sampling_latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        scale = self.pipeline.vae_scale_factor
        return (self.pipeline.vae.config.z_dim, height // scale, width // scale)

    def sampling_schedule(self, num_inference_steps: int, latent_shape: Sequence[int]) -> dict[str, Any]:
        """``linspace(1, 1 / N, N)`` shifted by ``mu`` of the packed token count, as the pipeline does."""
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps).tolist()
        return {"sigmas": sigmas, "mu": resolution_shift(self.pipeline.scheduler.config, latent_shape)}

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> list[dict[str, Tensor]]:
        embeds, mask = self.pipeline.encode_prompt(list(prompts), device=self.device)
        lengths = [embeds.shape[1]] * len(prompts) if mask is None else mask.sum(dim=1).tolist()
        return [{"encoder_hidden_states": e[:n].float()} for e, n in zip(embeds, lengths, strict=True)]

    def transformer_inputs(self, latents: Tensor, context: Sequence[dict[str, Tensor]], sigmas: Tensor) -> dict:
        b, c, h, w = latents.shape
        device = latents.device
        texts = [sample["encoder_hidden_states"] for sample in context]
        longest = max(t.shape[0] for t in texts)
        padded = torch.stack([torch.cat([t, t.new_zeros(longest - t.shape[0], t.shape[1])]) for t in texts])
        mask = torch.stack([torch.arange(longest) < t.shape[0] for t in texts]).long()
        return {
            "hidden_states": QwenImagePipeline._pack_latents(latents, b, c, h, w),
            "encoder_hidden_states": padded.to(device),
            "encoder_hidden_states_mask": None if bool(mask.all()) else mask.to(device),
            "timestep": sigmas.to(device),
            "img_shapes": [[(1, h // 2, w // 2)]] * b,
        }

    def prediction_to_latents(self, prediction: Tensor, latent_shape: Sequence[int]) -> Tensor:
        scale = self.pipeline.vae_scale_factor
        h, w = latent_shape[-2:]
        return QwenImagePipeline._unpack_latents(prediction, h * scale, w * scale, scale)[:, :, 0]

    def latents_to_prediction(self, latents: Tensor) -> Tensor:
        return QwenImagePipeline._pack_latents(latents, *latents.shape)

    @staticmethod
    def combine_guidance(cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
        """The pipeline's true CFG: the combination rescaled to the conditional prediction's norm per token."""
        combined = uncond + scale * (cond - uncond)
        return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    @torch.no_grad()
    def decode_latents(self, latents: Tensor) -> Tensor:
        vae = self.pipeline.vae
        x = latents[:, :, None].to(self.device, torch.float32) * self.latents_std + self.latents_mean
        return vae.decode(x.to(vae.dtype), return_dict=False)[0][:, :, 0].float().clamp(-1, 1)
