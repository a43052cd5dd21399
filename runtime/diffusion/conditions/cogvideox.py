"""CogVideoX condition model: T5 text encoder and AutoencoderKLCogVideoX, loaded from a ``CogVideoXPipeline``
directory; RoPE (CogVideoX-5b style checkpoints, ``use_rotary_positional_embeddings``) computed by the pipeline's own
``_prepare_rotary_positional_embeddings`` and passed to the transformer, as the pipeline does.

Unlike the flow-matching DiTs, CogVideoX is a v-prediction diffusion model (``CogVideoXDDIMScheduler``): integer
timesteps uniform over the training range, noisy latents from the scheduler's ``add_noise``, and the target the
scheduler's velocity ``sqrt(a_t) noise - sqrt(1 - a_t) x0``. diffusers' CogVideoX training script instead compares
the x0 the model's velocity implies with x0, weighted by ``1 / (1 - a_t)``; since
``x0_pred - x0 = -sqrt(1 - a_t) (v_pred - v)`` the two losses are the same, so the plain MSE on v with weight 1 is
that recipe. ``sigmas`` reports ``sqrt(1 - a_t)`` (the noise's standard deviation). Latents are the VAE posterior's
mode times ``scaling_factor``, laid out ``(F, C, h, w)`` as the transformer takes them.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers import CogVideoXPipeline
from torch import Tensor

from runtime.diffusion.conditions.base import ConditionInputs, ConditionModel, stack_context
from runtime.diffusion.timesteps import TimestepSampler

__all__ = ["CogVideoXConditionModel"]

TEXT_LENGTH = 226  # the pipeline's max_sequence_length


def _rotary(transformer_config: dict[str, Any], height: int, width: int, frames: int) -> tuple[Tensor, Tensor] | None:
    """The RoPE tables the pipeline computes for a video of ``height x width`` pixels and ``frames`` latent frames,
    through the pipeline's own method on a stand-in holding what it reads; None for checkpoints without RoPE."""
    if not transformer_config.get("use_rotary_positional_embeddings"):
        return None
    config = types.SimpleNamespace(
        patch_size=transformer_config.get("patch_size", 2),
        patch_size_t=transformer_config.get("patch_size_t"),
        sample_width=transformer_config.get("sample_width", 90),
        sample_height=transformer_config.get("sample_height", 60),
        attention_head_dim=transformer_config.get("attention_head_dim", 64),
    )
    stand_in = types.SimpleNamespace(vae_scale_factor_spatial=8, transformer=types.SimpleNamespace(config=config))
    return CogVideoXPipeline._prepare_rotary_positional_embeddings(
        stand_in, height, width, frames, torch.device("cpu")
    )


class CogVideoXConditionModel(ConditionModel):
    pipeline_class = CogVideoXPipeline
    components = ("tokenizer", "text_encoder", "vae")
    prediction = "v"
    video = True
    temporal_multiple = 4  # AutoencoderKLCogVideoX: the first frame, then 4 frames per latent frame
    # 5 frames -> 2 latent frames; 32 px -> 4x4 latents -> 2x2 tokens per frame (patch 2)
    example_pixels = (3, 5, 32, 32)
    pipeline_call = {"num_frames": 5, "guidance_scale": 1.0, "use_dynamic_cfg": False}

    def __init__(self, pipeline: Any, sampler: TimestepSampler, transformer_config: dict[str, Any]) -> None:
        super().__init__(pipeline, sampler)
        self.transformer_config = transformer_config
        self.scheduler = pipeline.scheduler
        self.num_train_timesteps = pipeline.scheduler.config.num_train_timesteps

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, encoders: bool = True, **sampler_overrides: Any
    ) -> CogVideoXConditionModel:
        """``sampler_overrides`` may only shape the uniform draw (``distribution``); the v-prediction recipe has no
        shift or weighting."""
        pipeline = cls.load_pipeline(path, encoders=encoders)
        transformer_config = json.loads((Path(path) / "transformer" / "config.json").read_text())
        return cls(pipeline, TimestepSampler(**sampler_overrides), transformer_config)

    def encode_sample(self, pixels: Tensor) -> Tensor:
        """Scaled VAE latents ``(F, C, h, w)`` of one (C, F, H, W) video (the posterior's mode times
        ``scaling_factor``), laid out as the transformer takes them."""
        return (self.vae_mode(pixels) * self.pipeline.vae.config.scaling_factor)[0].permute(1, 0, 2, 3)

    @torch.no_grad()
    def get_condition(self, inputs: Sequence[str], videos: Sequence[Tensor]) -> dict[str, list]:
        if len(inputs) != len(videos):
            raise ValueError(f"get_condition: {len(inputs)} prompts for {len(videos)} videos")
        embeds, _ = self.pipeline.encode_prompt(
            list(inputs),
            do_classifier_free_guidance=False,
            max_sequence_length=TEXT_LENGTH,
            device=self.device,
            dtype=torch.float32,
        )
        context = [{"encoder_hidden_states": e.float()} for e in embeds]
        return {"latents": [self.encode_sample(video) for video in videos], "context": context}

    def loss_weight(self, sigmas: Tensor, seq_len: int = 0) -> Tensor:
        """1 per sample: the MSE on v is the training script's ``1 / (1 - a_t)``-weighted x0 loss (module doc)."""
        return torch.ones_like(sigmas)

    def process_condition(
        self, latents: Sequence[Tensor], context: Sequence[dict[str, Tensor]], generator: torch.Generator | None = None
    ) -> ConditionInputs:
        x0 = torch.stack(list(latents)).to(self.device)
        b, f, _, h, w = x0.shape
        u = self.sampler.sample(b, 0, generator)
        timesteps = (u * self.num_train_timesteps).long().clamp(max=self.num_train_timesteps - 1).to(self.device)
        noise = self.noise_like(x0, generator)
        noisy = self.scheduler.add_noise(x0, noise, timesteps)
        target = self.scheduler.get_velocity(x0, noise, timesteps)
        alphas = self.scheduler.alphas_cumprod.to(self.device, torch.float32)[timesteps]
        inputs: dict[str, Any] = {
            "hidden_states": noisy,
            "encoder_hidden_states": stack_context(context, "encoder_hidden_states").to(self.device),
            "timestep": timesteps,
        }
        rotary = _rotary(self.transformer_config, h * 8, w * 8, f)
        if rotary is not None:
            inputs["image_rotary_emb"] = tuple(t.to(self.device) for t in rotary)
        return ConditionInputs(inputs, target, (1 - alphas).sqrt())

    @classmethod
    def tiny_components(cls, config: dict[str, Any], variant: str | None) -> dict[str, Any]:
        from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler

        from runtime.diffusion.tiny_pipelines import tiny_t5, tiny_tokenizer

        tokenizer = tiny_tokenizer()
        return dict(
            tokenizer=tokenizer,
            text_encoder=tiny_t5(tokenizer, config["text_embed_dim"]),
            vae=AutoencoderKLCogVideoX(  # x8 spatial, x4 temporal: the scale factors the pipeline assumes
                latent_channels=config["in_channels"],
                block_out_channels=(8, 8, 8, 8),
                layers_per_block=1,
                norm_num_groups=4,
            ),
            scheduler=CogVideoXDDIMScheduler(  # CogVideoX-2b's released scheduler settings
                beta_start=0.00085,
                beta_end=0.012,
                beta_schedule="scaled_linear",
                clip_sample=False,
                prediction_type="v_prediction",
                rescale_betas_zero_snr=True,
                set_alpha_to_one=True,
                snr_shift_scale=3.0,
                timestep_spacing="trailing",
            ),
        )
