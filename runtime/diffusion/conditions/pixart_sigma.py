"""PixArt-Sigma condition model: a T5 text encoder (``PixArtSigmaPipeline.encode_prompt``: 300 tokens padded on the
right, the encoder's last hidden state and its attention mask, which the transformer turns into a cross-attention
bias) and ``AutoencoderKL`` (SDXL's VAE: latents ``z * scaling_factor``, no shift), loaded from a
``PixArtSigmaPipeline`` directory.

PixArt is a DDPM noise-prediction model with a learned variance, not a flow-matching one: the recipe is
``runtime/diffusion/ddpm.py`` (integer timesteps uniform over the scheduler's training range, ``x_t = sqrt(abar_t) x0
+ sqrt(1 - abar_t) eps``, the MSE on the noise channels of the output, the variance channels untrained), with the
betas of the pipeline's own scheduler config. Latents are unpacked ``(C, h, w)`` (the transformer patchifies, patch
2); the transformer's ``timestep`` is the integer ``t``, and ``added_cond_kwargs`` carries no resolution or aspect
ratio, as ``PixArtSigmaPipeline`` calls it (PixArt-Sigma's transformers have ``use_additional_conditions`` off; a
transformer with them on is refused here, as that pipeline cannot run it either).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers import PixArtSigmaPipeline
from torch import Tensor

from runtime.diffusion.conditions.base import ConditionInputs, ConditionModel, stack_context
from runtime.diffusion.ddpm import DDPMObjective
from runtime.diffusion.timesteps import TimestepSampler

__all__ = ["PixArtSigmaConditionModel"]

TEXT_LENGTH = 300  # the pipeline's max_sequence_length
DRAW_OPTIONS = ("distribution", "logit_mean", "logit_std")  # what may shape the draw u of t = floor(u T)


class PixArtSigmaConditionModel(ConditionModel):
    pipeline_class = PixArtSigmaPipeline
    components = ("tokenizer", "text_encoder", "vae")
    prediction = "epsilon"
    pixel_multiple = 16  # vae_scale_factor (8) x patch (2)
    # 32x48 px -> 4x6 latents -> 2x3 tokens (patch 2)
    example_pixels = (3, 32, 48)
    # no CFG (the call's first sample is then the conditional one), no resolution binning (the size as given)
    pipeline_call = {"guidance_scale": 1.0, "use_resolution_binning": False}

    def __init__(self, pipeline: Any, sampler: TimestepSampler, transformer_config: dict[str, Any]) -> None:
        super().__init__(pipeline, sampler)
        if transformer_config.get("use_additional_conditions"):
            raise ValueError(
                "transformer/config.json: use_additional_conditions is true (PixArt-Alpha 1024's resolution and "
                "aspect-ratio conditions); PixArtSigmaPipeline passes none, so a PixArt-Sigma run cannot train it: "
                "use a PixArt-Sigma checkpoint (use_additional_conditions false)"
            )
        self.objective = DDPMObjective.from_configs(pipeline.scheduler.config, transformer_config)
        if self.has_encoders:
            self.scaling_factor = pipeline.vae.config.scaling_factor

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, encoders: bool = True, **sampler_overrides: Any
    ) -> PixArtSigmaConditionModel:
        """``sampler_overrides`` may only shape the draw ``u`` of ``t = floor(u T)`` (``DRAW_OPTIONS``); the DDPM
        recipe has no shift, weighting or range, so any of those is refused rather than ignored."""
        unknown = sorted(set(sampler_overrides) - set(DRAW_OPTIONS))
        if unknown:
            raise ValueError(
                f"{', '.join(unknown)}: not part of PixArt-Sigma's DDPM recipe (t = floor(u T), loss weight 1); only "
                f"{', '.join(DRAW_OPTIONS)} shape the draw u"
            )
        pipeline = cls.load_pipeline(path, encoders=encoders)
        transformer_config = json.loads((Path(path) / "transformer" / "config.json").read_text())
        return cls(pipeline, TimestepSampler(**sampler_overrides), transformer_config)

    def encode_sample(self, pixels: Tensor) -> Tensor:
        """Normalized VAE latents (C, h, w) of one (C, H, W) image: ``z * scaling_factor`` (the pipeline decodes
        ``latents / scaling_factor``)."""
        return (self.vae_mode(pixels) * self.scaling_factor)[0]

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> list[dict[str, Tensor]]:
        """``pipe.encode_prompt`` as the pipeline's call runs it (``clean_caption=True``, its default there, which
        falls back to the raw caption without bs4 / ftfy; 300 tokens): the padded state and its mask."""
        embeds, mask, _, _ = self.pipeline.encode_prompt(
            list(prompts),
            do_classifier_free_guidance=False,
            device=self.device,
            clean_caption=True,
            max_sequence_length=TEXT_LENGTH,
        )
        return [
            {"encoder_hidden_states": e.float(), "encoder_attention_mask": m}
            for e, m in zip(embeds, mask, strict=True)
        ]

    def loss_weight(self, sigmas: Tensor, seq_len: int = 0) -> Tensor:
        """1 per sample: diffusers' PixArt training scripts weight nothing (no ``snr_gamma``)."""
        return torch.ones_like(sigmas)

    def prediction_to_latents(self, prediction: Tensor, latent_shape: Sequence[int]) -> Tensor:
        """The noise channels of the output (the pipeline's ``noise_pred.chunk(2, dim=1)[0]``)."""
        return self.objective.predicted(prediction)

    def process_condition(
        self, latents: Sequence[Tensor], context: Sequence[dict[str, Tensor]], generator: torch.Generator | None = None
    ) -> ConditionInputs:
        """The DDPM recipe (``runtime/diffusion/ddpm.py``): ``t = floor(u T)``, ``x_t``, the noise as target in the
        output's layout, and the loss mask that keeps the noise channels under a learned variance."""
        x0 = torch.stack(list(latents)).to(self.device)
        timesteps = self.objective.timesteps(self.sampler.sample(x0.shape[0], 0, generator)).to(self.device)
        noisy, target, mask = self.objective.noisy_and_target(x0, self.noise_like(x0, generator), timesteps)
        inputs = ConditionInputs(
            {
                "hidden_states": noisy,
                "encoder_hidden_states": stack_context(context, "encoder_hidden_states").to(self.device),
                "encoder_attention_mask": stack_context(context, "encoder_attention_mask").to(self.device),
                "timestep": timesteps,
                "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
            },
            target,
            self.objective.noise_std(timesteps),
        )
        if mask is not None:
            inputs.loss_mask = mask
        return inputs

    @torch.no_grad()
    def decode_latents(self, latents: Tensor) -> Tensor:
        vae = self.pipeline.vae
        x = latents.to(self.device, torch.float32) / self.scaling_factor
        return vae.decode(x.to(vae.dtype), return_dict=False)[0].float().clamp(-1, 1)

    def sampling_latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        scale = self.pipeline.vae_scale_factor
        return (self.pipeline.vae.config.latent_channels, height // scale, width // scale)

    @classmethod
    def tiny_components(cls, config: dict[str, Any], variant: str | None) -> dict[str, Any]:
        """A one-layer T5 of width ``caption_channels``, a 4-block AutoencoderKL (the pipeline's 8x scale factor)
        with ``in_channels`` latent channels and SDXL's scaling factor, and PixArt-Sigma's released scheduler
        (DPM-Solver++ over DDPM's linear betas 1e-4 .. 0.02, epsilon prediction)."""
        from diffusers import AutoencoderKL, DPMSolverMultistepScheduler

        from runtime.diffusion.tiny_pipelines import tiny_t5, tiny_tokenizer

        tokenizer = tiny_tokenizer()
        return dict(
            tokenizer=tokenizer,
            text_encoder=tiny_t5(tokenizer, config["caption_channels"]),
            vae=AutoencoderKL(
                block_out_channels=[8, 8, 8, 8],
                down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4,
                latent_channels=config["in_channels"],
                layers_per_block=1,
                norm_num_groups=4,
                scaling_factor=0.13025,
            ),
            scheduler=DPMSolverMultistepScheduler(
                beta_start=0.0001,
                beta_end=0.02,
                beta_schedule="linear",
                num_train_timesteps=1000,
                prediction_type="epsilon",
                solver_order=2,
                algorithm_type="dpmsolver++",
            ),
        )
