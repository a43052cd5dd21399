"""Wan condition model: UMT5 text encoder + AutoencoderKLWan (T2V); I2V adds the CLIP image encoder and the
first-frame condition (latents of the first frame followed by zeros, and the first-frame mask). Wan2.2 TI2V (a
pipeline saved with ``expand_timesteps=True``, no image encoder): per-token timesteps ``(b, tokens)`` and, with a
first frame (``WanImageToVideoPipeline``), the first latent frame replaced by the image's clean latents, its tokens at
timestep 0 and left out of the loss (``loss_mask``), as the pipeline conditions on it.

Loaded from a ``WanPipeline`` or ``WanImageToVideoPipeline`` directory (I2V when its ``model_index.json`` names the
image-to-video pipeline). Text and image embeddings and the I2V condition come from the pipeline's own methods, so
training sees exactly what inference feeds the transformer. Noise levels: uniform, shifted by the scheduler's
``shift`` (``flow_shift``); the transformer's timestep is ``sigma * num_train_timesteps``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from torch import Tensor

from runtime.diffusion.conditions.base import ConditionModel, stack_context
from runtime.diffusion.timesteps import TimestepSampler

__all__ = ["EXPERTS", "WanConditionModel", "expert_boundary"]

# Wan2.2 A14B's experts: `transformer` denoises the high noise levels (timestep >= boundary_ratio * 1000),
# `transformer_2` the rest (WanPipeline.__call__)
EXPERTS = ("transformer", "transformer_2")
TEXT_LENGTH = 512  # the pipelines' max_sequence_length; Wan I2V attention requires exactly 512 text tokens


def expert_boundary(index: dict[str, Any], expert: str | None) -> tuple[float, float] | None:
    """The noise-level range [low, high) of ``expert`` of a pipeline's ``model_index.json`` (two transformers
    switched at ``boundary_ratio``: Wan2.2 A14B); None for no expert. A ValueError names what does not fit."""
    ratio = index.get("boundary_ratio")
    two = index.get("transformer_2", [None])[0] is not None and ratio is not None
    if expert is None:
        return None
    if not two:
        raise ValueError(f"expert {expert!r}: the pipeline has one transformer (no transformer_2 and boundary_ratio)")
    if expert not in EXPERTS:
        raise ValueError(f"expert must be one of {', '.join(EXPERTS)}, got {expert!r}")
    return (float(ratio), 1.0) if expert == "transformer" else (0.0, float(ratio))


def _to_pil(frame: Tensor) -> PIL.Image.Image:
    """A (C, H, W) frame in [-1, 1] as the 8-bit image an inference user would pass."""
    array = ((frame.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return PIL.Image.fromarray(np.ascontiguousarray(array.permute(1, 2, 0).numpy()))


class WanConditionModel(ConditionModel):
    pipeline_class = WanPipeline
    components = ("tokenizer", "text_encoder", "vae")
    optional_components = ("image_encoder", "image_processor")
    video = True
    temporal_multiple = 4  # AutoencoderKLWan: the first frame, then 4 frames per latent frame
    patch = (1, 2, 2)
    # 5 frames -> 2 latent frames; 32 px -> 4x4 latents -> 2x2 tokens per frame
    example_pixels = (3, 5, 32, 32)
    pipeline_call = {"num_frames": 5, "guidance_scale": 3.0}

    @classmethod
    def tiny_pipeline_class(cls, variant: str | None) -> type:
        return WanImageToVideoPipeline if variant in ("i2v", "ti2v") else WanPipeline

    @classmethod
    def tiny_components(cls, config: dict[str, Any], variant: str | None) -> dict[str, Any]:
        from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler

        from runtime.diffusion.tiny_pipelines import tiny_clip_vision, tiny_t5, tiny_tokenizer

        tokenizer = tiny_tokenizer()
        components: dict[str, Any] = dict(
            tokenizer=tokenizer,
            text_encoder=tiny_t5(tokenizer, config["text_dim"], umt5=True, d_kv=4, relative_attention_max_distance=32),
            # 3 spatial downsamples (x8) and 2 temporal ones (x4): the scale factors the pipelines assume
            vae=AutoencoderKLWan(
                base_dim=8,
                z_dim=config["out_channels"],
                dim_mult=[1, 1, 1, 1],
                num_res_blocks=1,
                temperal_downsample=[False, True, True],
                latents_mean=[0.1, -0.2, 0.3, -0.1],
                latents_std=[1.5, 0.8, 1.2, 2.0],
            ),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        )
        if variant == "i2v":
            components["image_encoder"], components["image_processor"] = tiny_clip_vision(config["image_dim"])
        if variant == "ti2v":  # Wan2.2 TI2V-5B: per-token timesteps, first-frame conditioning, no CLIP
            components["expand_timesteps"] = True
        return components

    def pipeline_inputs(self, pixels: Tensor) -> dict[str, Any]:
        return {"image": _to_pil(pixels[:, 0])} if self.i2v else {}

    def __init__(self, pipeline: Any, sampler: TimestepSampler) -> None:
        super().__init__(pipeline, sampler)
        self.i2v = isinstance(pipeline, WanImageToVideoPipeline)
        self.expert: str | None = None  # from_pretrained's expert: the trained one of two (Wan2.2 A14B)
        self.expand_timesteps = bool(getattr(pipeline.config, "expand_timesteps", False))
        if self.has_encoders:
            vae = pipeline.vae.config
            mean, std = torch.tensor(vae.latents_mean), torch.tensor(vae.latents_std)
            self.register_buffer("latents_mean", mean.view(1, -1, 1, 1, 1), persistent=False)
            self.register_buffer("latents_std", std.view(1, -1, 1, 1, 1), persistent=False)
        self.num_train_timesteps = pipeline.scheduler.config.num_train_timesteps

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, encoders: bool = True, expert: str | None = None, **sampler_overrides: Any
    ) -> WanConditionModel:
        """``sampler_overrides`` change the recipe: uniform levels shifted by the scheduler's shift, MSE weighted by
        the ``bell`` bump over the noise level (``runtime/diffusion/timesteps.py``). ``expert``: of a pipeline with
        two transformers switched at ``boundary_ratio`` (Wan2.2 A14B), the one trained (``transformer``: the
        high-noise levels ``sigma >= boundary_ratio``; ``transformer_2``: below); the levels are drawn in its range
        only, so each sample's loss belongs to the expert the pipeline would run at its timestep."""
        index = json.loads((Path(path) / "model_index.json").read_text())
        pipeline_class = WanImageToVideoPipeline if index["_class_name"] == "WanImageToVideoPipeline" else WanPipeline
        boundary = expert_boundary(index, expert)
        if boundary is not None:
            sampler_overrides = {**dict(zip(("low", "high"), boundary, strict=True)), **sampler_overrides}
        pipeline = cls.load_pipeline(path, encoders=encoders, pipeline_class=pipeline_class)
        sampler = TimestepSampler.from_scheduler_config(
            pipeline.scheduler.config, **{"weighting": "bell", **sampler_overrides}
        )
        model = cls(pipeline, sampler)
        model.expert = expert
        return model

    def encode_sample(self, pixels: Tensor) -> Tensor:
        """Normalized VAE latents of one (C, F, H, W) video (per-channel ``latents_mean`` / ``latents_std``)."""
        return ((self.vae_mode(pixels) - self.latents_mean) / self.latents_std)[0]

    @torch.no_grad()
    def get_condition(self, inputs: Sequence[str], videos: Sequence[Tensor]) -> dict[str, list]:
        if len(inputs) != len(videos):
            raise ValueError(f"get_condition: {len(inputs)} prompts for {len(videos)} videos")
        latents, context = [], []
        for sample, video in zip(self.encode_prompts(inputs), videos, strict=True):
            x0 = self.encode_sample(video)
            if self.i2v:
                sample.update(self._first_frame(video, x0))
            latents.append(x0)
            context.append(sample)
        return {"latents": latents, "context": context}

    def _first_frame(self, video: Tensor, x0: Tensor) -> dict[str, Tensor]:
        """I2V: CLIP embeddings of the first frame (when the pipeline has an image encoder) and the pipeline's
        condition (mask + first-frame latents); TI2V (``expand_timesteps``): the first frame's clean latents."""
        pipe = self.pipeline
        frames, height, width = video.shape[1:]
        image = _to_pil(video[:, 0])
        pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(self.device, torch.float32)
        prepared = pipe.prepare_latents(
            pixels, 1, x0.shape[0], height, width, frames, torch.float32, self.device, None, x0[None]
        )
        if self.expand_timesteps:
            return {"first_frame_latents": prepared[1][0]}
        out = {"condition": prepared[1][0]}
        if getattr(pipe, "image_encoder", None) is not None:
            out["encoder_hidden_states_image"] = pipe.encode_image(image, self.device)[0].float()
        return out

    # ---- sampling (WanPipeline.__call__) ---------------------------------------------------------------------------

    def sampling_latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        pipe = self.pipeline
        frames = 1 if frames is None else frames
        latent_frames = (frames - 1) // pipe.vae_scale_factor_temporal + 1
        spatial = pipe.vae_scale_factor_spatial
        return (pipe.vae.config.z_dim, latent_frames, height // spatial, width // spatial)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> list[dict[str, Tensor]]:
        text, _ = self.pipeline.encode_prompt(
            list(prompts),
            do_classifier_free_guidance=False,
            max_sequence_length=TEXT_LENGTH,
            device=self.device,
            dtype=torch.float32,
        )
        return [{"encoder_hidden_states": prompt_embeds} for prompt_embeds in text]

    def transformer_inputs(self, latents: Tensor, context: Sequence[dict[str, Tensor]], sigmas: Tensor) -> dict:
        inputs: dict[str, Any] = {
            "hidden_states": latents,
            "timestep": (sigmas * self.num_train_timesteps).to(latents.device),
            "encoder_hidden_states": stack_context(context, "encoder_hidden_states").to(latents.device),
        }
        if self.expand_timesteps:
            mask = self.first_frame_mask(latents, context)
            if "first_frame_latents" in context[0]:
                first = stack_context(context, "first_frame_latents").to(latents)
                inputs["hidden_states"] = (1 - mask) * first + mask * latents
            # the pipelines' expand_timesteps: one timestep per patchified token, the first frame's at 0
            per_token = mask[0, 0][:: self.patch[0], :: self.patch[1], :: self.patch[2]].flatten()
            inputs["timestep"] = per_token[None] * inputs["timestep"].view(-1, 1)
        elif self.i2v:
            condition = stack_context(context, "condition").to(latents)
            inputs["hidden_states"] = torch.cat([latents, condition], dim=1)
            inputs["encoder_hidden_states_image"] = stack_context(context, "encoder_hidden_states_image").to(
                latents.device
            )
        return inputs

    def first_frame_mask(self, latents: Tensor, context: Sequence[dict[str, Tensor]]) -> Tensor:
        """TI2V: ``(1, 1, F, h, w)``, 0 on the first latent frame when the sample is conditioned on it, else 1."""
        mask = latents.new_ones((1, 1, *latents.shape[2:]))
        if "first_frame_latents" in context[0]:
            mask[:, :, 0] = 0
        return mask

    def process_condition(
        self, latents: Sequence[Tensor], context: Sequence[dict[str, Tensor]], generator: torch.Generator | None = None
    ) -> Any:
        """The flow-matching recipe; TI2V with a first frame: its latents are the clean condition, not predicted,
        so the loss leaves them out (``loss_mask``, read by the trainer's loss)."""
        inputs = super().process_condition(latents, context, generator)
        if self.expand_timesteps and "first_frame_latents" in context[0]:
            inputs.loss_mask = self.first_frame_mask(inputs.target, context).expand_as(inputs.target)
        return inputs

    @torch.no_grad()
    def decode_latents(self, latents: Tensor) -> Tensor:
        vae = self.pipeline.vae
        x = latents.to(self.device, torch.float32) * self.latents_std + self.latents_mean
        return vae.decode(x.to(vae.dtype), return_dict=False)[0].float().clamp(-1, 1)
