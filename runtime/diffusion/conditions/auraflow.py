"""AuraFlow condition model: a UMT5 text encoder (Pile-T5 in the released models: 256 tokens padded on the right,
the encoder's last hidden state **multiplied by its attention mask**, so padded tokens are zero vectors; no mask
reaches the transformer, which attends over every token) and ``AutoencoderKL`` (SDXL's VAE: latents
``z * scaling_factor``, no shift), loaded from an ``AuraFlowPipeline`` directory.

Latents are unpacked ``(C, h, w)`` (the transformer patchifies, patch 2; the pipeline's sizes are multiples of
``vae_scale_factor * 2``). The transformer's timestep is ``sigma`` in [0, 1] (its ``Timesteps`` embedding scales by
1000 itself): the pipeline passes ``t / 1000`` of the scheduler's ``t = sigma * num_train_timesteps``, computed here
the same way so the values are bitwise the pipeline's. Sampling: the scheduler's own grid
(``set_timesteps(num_inference_steps)``: no custom sigmas, no ``mu``), true classifier-free guidance with the
negative prompt encoded like a prompt (default scale 3.5, ``uncond + s (cond - uncond)``), decode
``latents / scaling_factor``.

Noise levels: diffusers ships no AuraFlow training script; SimpleTuner's AuraFlow recipe (its flow-matching default
for every flow model) draws ``sigma = sigmoid(N(0, 1))`` (``flow_sigmoid_scale = 1``), shifts it by its own
``flow_schedule_shift = 3`` (not the scheduler's shift) and regresses on ``noise - x0`` without loss weighting,
feeding the transformer ``sigma * 1000 / 1000``. That is the sampler used here: logit-normal, static shift 3.0
(``dit.condition`` overrides, e.g. ``shift``), no weighting.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from diffusers import AuraFlowPipeline
from torch import Tensor

from runtime.diffusion.conditions.base import ConditionModel, stack_context
from runtime.diffusion.timesteps import TimestepSampler

__all__ = ["AuraFlowConditionModel"]

TEXT_LENGTH = 256  # the pipeline's max_sequence_length (UMT5 tokens, padded to it)
TRAINING_SHIFT = 3.0  # SimpleTuner's flow_schedule_shift default (module doc)


class AuraFlowConditionModel(ConditionModel):
    pipeline_class = AuraFlowPipeline
    components = ("tokenizer", "text_encoder", "vae")
    pixel_multiple = 16  # AuraFlowPipeline.check_inputs: vae_scale_factor (8) x patch (2)
    # 32x48 px -> 4x6 latents -> 2x3 tokens (patch 2)
    example_pixels = (3, 32, 48)
    # no CFG: under CFG the pipeline batches [negative; conditional] in one call, and the suites read the call's first
    # sample as the conditional one (true CFG at the pipeline's default 3.5: tests/conditions/test_auraflow.py)
    pipeline_call = {"guidance_scale": 1.0}

    def __init__(self, pipeline: Any, sampler: TimestepSampler) -> None:
        super().__init__(pipeline, sampler)
        if self.has_encoders:
            self.scaling_factor = pipeline.vae.config.scaling_factor
        self.num_train_timesteps = pipeline.scheduler.config.num_train_timesteps

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, encoders: bool = True, **sampler_overrides: Any
    ) -> AuraFlowConditionModel:
        pipeline = cls.load_pipeline(path, encoders=encoders)
        return cls(pipeline, cls.training_sampler(pipeline.scheduler.config, **sampler_overrides))

    @staticmethod
    def training_sampler(config: Any, **overrides: Any) -> TimestepSampler:
        """SimpleTuner's AuraFlow noise levels (module doc): logit-normal (0, 1), shifted by 3.0 whatever the
        scheduler's sampling shift, no loss weighting; the scheduler config gives only what overrides leave."""
        defaults = {"distribution": "logit_normal", "dynamic": False, "shift": TRAINING_SHIFT, "weighting": "none"}
        return TimestepSampler.from_scheduler_config(config, **{**defaults, **overrides})

    def encode_sample(self, pixels: Tensor) -> Tensor:
        """Normalized VAE latents (C, h, w) of one (C, H, W) image: ``z * scaling_factor`` (the pipeline decodes
        ``latents / scaling_factor``; SDXL's VAE has no shift factor)."""
        return (self.vae_mode(pixels) * self.scaling_factor)[0]

    # ---- sampling (AuraFlowPipeline.__call__) ----------------------------------------------------------------------

    def sampling_latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """``prepare_latents``: ``(latent channels, H / vae_scale_factor, W / vae_scale_factor)``; the pipeline
        takes the channel count from the transformer's ``in_channels``, which equals the VAE's latent channels."""
        scale = self.pipeline.vae_scale_factor
        return (self.pipeline.vae.config.latent_channels, height // scale, width // scale)

    def sampling_schedule(self, num_inference_steps: int, latent_shape: Sequence[int]) -> dict[str, Any]:
        """The pipeline passes ``set_timesteps`` neither sigmas nor ``mu`` (``sigmas=None`` by default): the
        scheduler's own grid with its static shift."""
        return {}

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> list[dict[str, Tensor]]:
        """``pipe.encode_prompt`` itself (256 tokens, the state multiplied by the mask): its output is exactly what the
        pipeline feeds the transformer, and the mask is not passed on (the transformer takes none)."""
        embeds, _, _, _ = self.pipeline.encode_prompt(
            list(prompts), do_classifier_free_guidance=False, device=self.device, max_sequence_length=TEXT_LENGTH
        )
        return [{"encoder_hidden_states": e.float()} for e in embeds]

    def transformer_inputs(self, latents: Tensor, context: Sequence[dict[str, Tensor]], sigmas: Tensor) -> dict:
        """Unpacked latents and ``timestep = (sigma * N) / N``: the pipeline's ``t / 1000`` of the scheduler's
        ``t = sigma * N`` (N = ``num_train_timesteps``, 1000), so a rollout's timestep is the pipeline's bitwise."""
        device = latents.device
        n = self.num_train_timesteps
        return {
            "hidden_states": latents,
            "timestep": (sigmas.to(device) * n) / n,
            "encoder_hidden_states": stack_context(context, "encoder_hidden_states").to(device),
        }

    @torch.no_grad()
    def decode_latents(self, latents: Tensor) -> Tensor:
        vae = self.pipeline.vae
        x = latents.to(self.device, torch.float32) / self.scaling_factor
        return vae.decode(x.to(vae.dtype), return_dict=False)[0].float().clamp(-1, 1)

    @classmethod
    def tiny_components(cls, config: dict[str, Any], variant: str | None) -> dict[str, Any]:
        """A one-layer UMT5 of width ``joint_attention_dim`` (the pipeline's class), a 4-block AutoencoderKL (the
        pipeline's 8x scale factor from ``block_out_channels``) with ``in_channels`` latent channels and SDXL's
        scaling factor (0.13025, no shift: the VAE AuraFlow uses), and a flow-matching scheduler with a static shift
        other than 1 (1.73) so its grid differs from the unshifted one."""
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

        from runtime.diffusion.tiny_pipelines import tiny_t5, tiny_tokenizer

        tokenizer = tiny_tokenizer()
        return dict(
            tokenizer=tokenizer,
            text_encoder=tiny_t5(tokenizer, config["joint_attention_dim"], umt5=True),
            vae=AutoencoderKL(
                block_out_channels=[8, 8, 8, 8],
                down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4,
                latent_channels=config["in_channels"],
                layers_per_block=1,
                norm_num_groups=4,
                scaling_factor=0.13025,
            ),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=1.73),
        )
