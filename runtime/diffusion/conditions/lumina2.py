"""Lumina-Image 2.0 condition model: a Gemma2 text encoder (the pipeline's system prompt + ``" <Prompt Start> "``
prepended, 256 tokens padded on the right, the hidden state one layer below the top, with its attention mask) and
``AutoencoderKL`` (latents ``(z - shift_factor) * scaling_factor``), loaded from a ``Lumina2Pipeline`` directory.

Latents are unpacked ``(C, h, w)`` (the transformer patchifies, patch 2). **Time runs the other way**: Lumina's
``t = 0`` is noise, so the transformer takes ``timestep = 1 - sigma`` (the pipeline's ``1 - t / num_train_timesteps``)
and predicts ``x0 - noise``; the pipeline negates its output before ``scheduler.step``. Here the negation is
``latents_to_prediction`` (the training target, ``x0 - noise``: what diffusers' Lumina2 LoRA script regresses on)
and ``prediction_to_latents`` (the flow velocity ``noise - x0`` a Flow-GRPO rollout steps with), so the trainer and
the rollout see one convention, the base class's.

Noise levels: diffusers' ``train_dreambooth_lora_lumina2.py`` draws ``u`` uniformly (``weighting_scheme = "none"``,
no loss weighting), takes the scheduler's training sigma at that index and uses it as the weight of **x0**
(``(1 - s) noise + s x0``, timestep ``s``). The scheduler's static shift ``S`` thus lands on the clean side: the noise
level ``1 - shift_S(u)`` is distributed as ``shift_{1/S}(u')`` with ``u'`` uniform, which is the sampler used here
(``shift = 1 / S``; a dynamic-shifting scheduler's training grid is unshifted: ``shift = 1``). Overrides
(``dit.condition``) are in this module's convention: ``shift`` > 1 moves the levels towards noise.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from diffusers import Lumina2Pipeline
from diffusers.pipelines.lumina2.pipeline_lumina2 import calculate_shift
from torch import Tensor

from runtime.diffusion.conditions.base import ConditionModel, stack_context
from runtime.diffusion.timesteps import TimestepSampler

__all__ = ["Lumina2ConditionModel"]

TEXT_LENGTH = 256  # the pipeline's max_sequence_length (Gemma2 tokens, system prompt included)


class Lumina2ConditionModel(ConditionModel):
    pipeline_class = Lumina2Pipeline
    components = ("tokenizer", "text_encoder", "vae")
    pixel_multiple = 16  # Lumina2Pipeline.check_inputs: vae_scale_factor (8) x patch (2)
    # 32x48 px -> 4x6 latents -> 2x3 tokens (patch 2)
    example_pixels = (3, 32, 48)
    # the pipeline's default guidance (4.0, with its cfg_normalization); a non-empty negative prompt, because the
    # tiny test tokenizer adds no BOS token and "" would leave the negative branch without a caption token
    pipeline_call = {"guidance_scale": 4.0, "negative_prompt": "blurry"}

    def __init__(self, pipeline: Any, sampler: TimestepSampler) -> None:
        super().__init__(pipeline, sampler)
        if self.has_encoders:
            self.shift_factor = pipeline.vae.config.shift_factor or 0.0
            self.scaling_factor = pipeline.vae.config.scaling_factor
        self.num_train_timesteps = pipeline.scheduler.config.num_train_timesteps

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, encoders: bool = True, **sampler_overrides: Any
    ) -> Lumina2ConditionModel:
        pipeline = cls.load_pipeline(path, encoders=encoders)
        return cls(pipeline, cls.training_sampler(pipeline.scheduler.config, **sampler_overrides))

    @staticmethod
    def training_sampler(config: Any, **overrides: Any) -> TimestepSampler:
        """The LoRA script's noise levels (module doc): uniform, shifted by ``1 / shift`` of the scheduler's static
        shift, because the script uses the scheduler's sigma as the weight of x0, not of the noise."""
        shift = 1.0 if config.get("use_dynamic_shifting") else float(config.get("shift") or 1.0)
        defaults = {"distribution": "uniform", "dynamic": False, "shift": 1.0 / shift}
        return TimestepSampler.from_scheduler_config(config, **{**defaults, **overrides})

    def encode_sample(self, pixels: Tensor) -> Tensor:
        """Normalized VAE latents (C, h, w) of one (C, H, W) image: ``(z - shift_factor) * scaling_factor``."""
        return ((self.vae_mode(pixels) - self.shift_factor) * self.scaling_factor)[0]

    # ---- sampling (Lumina2Pipeline.__call__) ----------------------------------------------------------------------

    def sampling_latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """``prepare_latents``: 8x VAE, rounded down to the patch (2)."""
        scale = self.pipeline.vae_scale_factor * 2
        return (self.pipeline.vae.config.latent_channels, 2 * (height // scale), 2 * (width // scale))

    def sampling_schedule(self, num_inference_steps: int, latent_shape: Sequence[int]) -> dict[str, Any]:
        """``linspace(1, 1 / N, N)`` and the ``mu`` the pipeline passes.

        The pipeline computes ``image_seq_len = latents.shape[1]`` on unpacked ``(B, C, H, W)`` latents, i.e. the
        **channel count**, not the token count (a line copied from Flux, whose latents are packed
        ``(B, tokens, C)``). Reproduced as it is: ``mu`` of ``C`` (``latent_shape[0]``). It changes the schedule only
        under ``use_dynamic_shifting``; with a static shift the scheduler ignores ``mu``."""
        config = self.pipeline.scheduler.config
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        mu = calculate_shift(
            latent_shape[0],  # upstream quirk: latents.shape[1] of (B, C, H, W), the channel count
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        return {"sigmas": sigmas.tolist(), "mu": mu}

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> list[dict[str, Tensor]]:
        embeds, mask, _, _ = self.pipeline.encode_prompt(
            list(prompts), do_classifier_free_guidance=False, device=self.device, max_sequence_length=TEXT_LENGTH
        )
        return [
            {"encoder_hidden_states": e.float(), "encoder_attention_mask": m}
            for e, m in zip(embeds, mask, strict=True)
        ]

    @torch.no_grad()
    def encode_negative_prompts(self, prompts: Sequence[str]) -> list[dict[str, Tensor]]:
        """``encode_prompt``'s negative branch, which tokenizes the negative prompt **without** the system prompt
        (what the pipeline's unconditional prediction sees under CFG). Taken from that very call, so it cannot
        drift from it."""
        prompts = list(prompts)
        _, _, embeds, mask = self.pipeline.encode_prompt(
            prompts,
            do_classifier_free_guidance=True,
            negative_prompt=prompts,
            device=self.device,
            max_sequence_length=TEXT_LENGTH,
        )
        return [
            {"encoder_hidden_states": e.float(), "encoder_attention_mask": m}
            for e, m in zip(embeds, mask, strict=True)
        ]

    def transformer_inputs(self, latents: Tensor, context: Sequence[dict[str, Tensor]], sigmas: Tensor) -> dict:
        """Unpacked latents, ``timestep = 1 - sigma`` computed as the pipeline does from the scheduler's timestep
        ``t = sigma * N`` (``1 - t / N``), so a rollout's inputs equal the pipeline's bitwise."""
        device = latents.device
        n = self.num_train_timesteps
        return {
            "hidden_states": latents,
            "timestep": 1 - (sigmas.to(device) * n) / n,
            "encoder_hidden_states": stack_context(context, "encoder_hidden_states").to(device),
            "encoder_attention_mask": stack_context(context, "encoder_attention_mask").to(device),
        }

    def prediction_to_latents(self, prediction: Tensor, latent_shape: Sequence[int]) -> Tensor:
        """The flow velocity ``noise - x0``: the transformer predicts ``x0 - noise`` (the pipeline's
        ``noise_pred = -noise_pred`` before ``scheduler.step``)."""
        return -prediction

    def latents_to_prediction(self, latents: Tensor) -> Tensor:
        """The training target as the transformer outputs it: ``-(noise - x0) = x0 - noise``."""
        return -latents

    @staticmethod
    def combine_guidance(cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
        """The pipeline's default ``cfg_normalization``: CFG, rescaled to the conditional prediction's norm. The norm
        is upstream's ``torch.norm(..., dim=-1)`` of the ``(B, C, H, W)`` output: over the latent **width**, per
        (channel, row), reproduced as it is. (``cfg_trunc_ratio`` defaults to 1.0: guidance on every step.)"""
        pred = uncond + scale * (cond - uncond)
        return pred * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(pred, dim=-1, keepdim=True))

    @torch.no_grad()
    def decode_latents(self, latents: Tensor) -> Tensor:
        vae = self.pipeline.vae
        x = latents.to(self.device, torch.float32) / self.scaling_factor + self.shift_factor
        return vae.decode(x.to(vae.dtype), return_dict=False)[0].float().clamp(-1, 1)

    @classmethod
    def tiny_components(cls, config: dict[str, Any], variant: str | None) -> dict[str, Any]:
        """A two-layer Gemma2 of width ``cap_feat_dim`` (the pipeline reads the penultimate hidden state), a 4-block
        AutoencoderKL (the pipeline's fixed 8x scale) with ``in_channels`` latent channels and Flux's VAE factors
        (Lumina-Image 2.0 uses Flux's VAE), and a flow-matching scheduler with a static shift (6.0), so the training
        sampler's mirrored shift (1 / 6) is exercised."""
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
        from transformers import Gemma2Config, Gemma2Model

        from runtime.diffusion.tiny_pipelines import tiny_tokenizer

        tokenizer = tiny_tokenizer()
        text_encoder = Gemma2Model(
            Gemma2Config(
                vocab_size=len(tokenizer),
                hidden_size=config["cap_feat_dim"],
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
                max_position_embeddings=8192,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        vae = AutoencoderKL(
            block_out_channels=[8, 8, 8, 8],
            down_block_types=["DownEncoderBlock2D"] * 4,
            up_block_types=["UpDecoderBlock2D"] * 4,
            latent_channels=config["in_channels"],
            layers_per_block=1,
            norm_num_groups=4,
            shift_factor=0.1159,
            scaling_factor=0.3611,
        )
        return dict(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=6.0),
        )
