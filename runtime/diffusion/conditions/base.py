"""The frozen condition model of a DiT: VAE + text encoder(s) + scheduler settings, loaded from a diffusers pipeline
directory, never parallelised, never trained.

API (what a DiT trainer relies on):

* ``get_condition(inputs, videos) -> {"latents": [...], "context": [...]}``: ``inputs`` are the samples' prompts
  (one ``str`` each), ``videos`` their pixels in [-1, 1] (``(C, F, H, W)`` videos for Wan, ``(C, H, W)`` images for
  Flux / Qwen-Image). Returns one entry per sample: ``latents[i]`` the normalized VAE latents the transformer
  denoises, ``context[i]`` a dict of the sample's conditioning tensors, named like the transformer's forward
  parameters they feed. Everything is computed under ``torch.no_grad`` with the pipeline's own encoders, so a
  trainer can cache it.
* ``process_condition(latents, context, generator=None) -> ConditionInputs``: samples noise and noise levels as the
  model's training recipe does, builds the noisy latents ``(1 - sigma) x0 + sigma noise`` (packed / concatenated
  as the transformer takes them) and the flow-matching target ``noise - x0``. The returned dict's keys are exactly
  the transformer's forward parameter names (``transformer(**inputs)``); the target and the noise levels are its
  attributes ``.target`` and ``.sigmas``. SP ranks of one group must pass identically seeded generators: they hold
  the same sample and must draw the same noise. ``generator`` may also be a sequence with one generator per sample
  (each sample's noise level and noise come from its own), so a sample's draws do not depend on its batch.
* ``loss_weight(sigmas)``: the per-sample weight of the flow-matching MSE in the model's recipe
  (``runtime/diffusion/timesteps.py``).

``from_pretrained(path, encoders=False)`` loads only what ``process_condition`` needs (scheduler settings): a
trainer that reads cached conditions never loads the VAE or the text encoders.

What else differs per model lives here too, so a DiT is its spec plus its condition model module
(``runtime/diffusion/conditions/<condition_model_type>.py``, found by that name): ``tiny_components`` (tiny random
pipeline components around the spec's tiny transformer, for tests and demos) and the facts of a short pipeline call
(``example_pixels``, ``pipeline_call``, ``pipeline_inputs``). The spec-driven DiT suites read only these (and the
transformer's random inputs from ``tests/fixtures/dit_inputs.py``).

Sampling (what a Flow-GRPO rollout needs to denoise as the model's own pipeline does, ``runtime/rl/adapters/dit.py``):
``sampling_latent_shape`` (one sample's latents for a pixel size), ``sampling_schedule`` (the arguments the
pipeline gives ``scheduler.set_timesteps``: its ``sigmas`` and resolution shift ``mu``), ``encode_prompts`` (the
per-sample context ``get_condition`` returns, without pixels), ``encode_negative_prompts`` (the negative prompt's
context under true CFG, as the pipeline encodes its ``negative_prompt``: a prompt like any other, except where the
pipeline treats it differently, e.g. Lumina2 leaves out its system prompt), ``transformer_inputs`` (the
transformer's kwargs for latents at given noise levels: ``process_condition``'s layout, no noise drawn),
``prediction_to_latents`` (unpack the transformer's output, and turn it into the flow velocity ``noise - x0`` where
the transformer predicts another sign: Lumina2), ``combine_guidance`` (how the pipeline mixes its conditional and
negative predictions under true CFG) and ``decode_latents`` (pixels in [-1, 1] for rewards).
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from runtime.diffusion.timesteps import TimestepSampler

__all__ = ["ConditionInputs", "ConditionModel", "resolution_shift", "stack_context"]


class ConditionInputs(dict):
    """Forward kwargs of the transformer (keys = its forward parameter names) plus the training target."""

    def __init__(self, inputs: dict[str, Any], target: Tensor, sigmas: Tensor) -> None:
        super().__init__(inputs)
        self.target = target
        self.sigmas = sigmas


def stack_context(context: Sequence[dict[str, Tensor]], key: str) -> Tensor:
    return torch.stack([sample[key] for sample in context])


def resolution_shift(config: Any, latent_shape: Sequence[int], max_shift: float = 1.15) -> float:
    """The ``mu`` the pipelines with dynamic shifting pass ``set_timesteps`` for latents of ``latent_shape``: the
    scheduler ``config``'s shift line (the pipelines' defaults, ``max_shift`` their own) at the 2x2-patch token count.
    Flux's ``calculate_shift``: the other pipelines' are copies of it."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    tokens = (latent_shape[-2] // 2) * (latent_shape[-1] // 2)
    return calculate_shift(
        tokens,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", max_shift),
    )


class ConditionModel(nn.Module):
    """Base of the per-model condition models: holds the frozen pipeline components and the timestep sampler."""

    #: the diffusers pipeline class whose directory layout and encoders this model uses
    pipeline_class: ClassVar[type]
    #: components of that pipeline this model loads (the transformer is never among them)
    components: ClassVar[tuple[str, ...]]
    #: optional components (loaded when the directory has them)
    optional_components: ClassVar[tuple[str, ...]] = ()
    #: what ``get_condition`` takes: videos ``(C, F, H, W)`` or images ``(C, H, W)``
    video: ClassVar[bool] = False
    #: pixel sizes must be multiples of this (VAE downsampling x the transformer's patch / packing)
    pixel_multiple: ClassVar[int] = 16
    #: video frame counts must be ``temporal_multiple * k + 1`` (the VAE's temporal compression)
    temporal_multiple: ClassVar[int] = 1
    #: what the transformer predicts: "flow" (flow matching: ``x_s = (1 - s) x0 + s noise``, target ``noise - x0``)
    #: or "v" (DDPM v-prediction: ``x_t = sqrt(1 - s^2) x0 + s noise``, target ``sqrt(1 - s^2) noise - s x0``, with
    #: ``s`` the noise's standard deviation); FlowGRPO and the flow schedulers need "flow"
    prediction: ClassVar[str] = "flow"
    #: the transformer's patch over the latents' (frames,) height and width: its token count shifts the noise levels
    patch: ClassVar[tuple[int, ...]] = (2, 2)
    #: one sample's pixels for a short pipeline call in tests: ``(C, F, H, W)`` video or ``(C, H, W)`` image
    example_pixels: ClassVar[tuple[int, ...]] = (3, 32, 48)
    #: keyword arguments of that call besides prompt, size and steps (guidance, frames)
    pipeline_call: ClassVar[dict[str, Any]] = {}

    def __init__(self, pipeline: Any, sampler: TimestepSampler) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.sampler = sampler
        for name in (*self.components, *self.optional_components):
            module = getattr(pipeline, name, None)
            if isinstance(module, nn.Module):
                module.requires_grad_(False)
                module.eval()
                self.add_module(name, module)
        super().train(False)

    @classmethod
    def load_pipeline(cls, path: str | os.PathLike, encoders: bool = True, **kwargs: Any) -> Any:
        """The pipeline from ``path`` without its transformer(s): the condition side only. ``encoders=False`` also
        leaves out the VAE, text/image encoders and tokenizers (what ``process_condition`` does not use)."""
        pipeline_class = kwargs.pop("pipeline_class", cls.pipeline_class)
        accepted = inspect.signature(pipeline_class.__init__).parameters
        skipped = ("transformer", "transformer_2")
        if not encoders:
            skipped += (*cls.components, *cls.optional_components)
        none = {name: None for name in skipped if name in accepted}
        return pipeline_class.from_pretrained(path, **none, **kwargs)

    @classmethod
    def tiny_pipeline_class(cls, variant: str | None) -> type:
        """The pipeline class of a tiny variant (e.g. Wan's ``i2v``: the image-to-video pipeline)."""
        return cls.pipeline_class

    @classmethod
    def tiny_components(cls, config: dict[str, Any], variant: str | None) -> dict[str, Any]:
        """Tiny random pipeline components (all but the transformer) that fit the tiny transformer ``config``."""
        raise NotImplementedError(f"{cls.__name__} has no tiny pipeline components")

    def pipeline_inputs(self, pixels: Tensor) -> dict[str, Any]:
        """Extra inputs of a pipeline call for a sample with these pixels (Wan I2V: the first frame)."""
        return {}

    def train(self, mode: bool = True) -> ConditionModel:
        return super().train(False)  # frozen: always in eval mode

    @property
    def has_encoders(self) -> bool:
        """Whether ``get_condition`` can run (False when loaded with ``encoders=False``)."""
        return getattr(self.pipeline, "vae", None) is not None

    @property
    def device(self) -> torch.device:
        if self.has_encoders:
            return self.pipeline.vae.device
        return next((b.device for b in self.buffers()), torch.device("cpu"))

    def loss_weight(self, sigmas: Tensor, seq_len: int = 0) -> Tensor:
        """Per-sample weights of the flow-matching MSE (the recipe's ``TimestepSampler.weighting``)."""
        return self.sampler.loss_weight(sigmas, seq_len)

    # ---- sampling: the facts of the pipeline's own denoising loop ------------------------------------------------

    def sampling_latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """One sample's (unpacked) latent shape for a ``height`` x ``width`` image (or a ``frames``-frame video)."""
        raise NotImplementedError(f"{type(self).__name__} has no sampling support")

    def sampling_schedule(self, num_inference_steps: int, latent_shape: Sequence[int]) -> dict[str, Any]:
        """What the pipeline passes ``scheduler.set_timesteps`` besides the step count: ``{"sigmas": ...}`` when it
        passes its own sigmas, ``{"mu": ...}`` with a resolution-dependent shift; ``{}`` for the scheduler's grid."""
        return {}

    def encode_prompts(self, prompts: Sequence[str]) -> list[dict[str, Tensor]]:
        """Each prompt's conditioning, as ``get_condition``'s ``context`` entries."""
        raise NotImplementedError(f"{type(self).__name__} has no sampling support")

    def encode_negative_prompts(self, prompts: Sequence[str]) -> list[dict[str, Tensor]]:
        """Each negative prompt's conditioning under true CFG, as the pipeline encodes its ``negative_prompt``: by
        default exactly like a prompt."""
        return self.encode_prompts(prompts)

    def transformer_inputs(self, latents: Tensor, context: Sequence[dict[str, Tensor]], sigmas: Tensor) -> dict:
        """The transformer's forward kwargs for (unpacked) ``latents`` at noise levels ``sigmas`` (one per sample),
        laid out as ``process_condition`` lays them out."""
        raise NotImplementedError(f"{type(self).__name__} has no sampling support")

    def prediction_to_latents(self, prediction: Tensor, latent_shape: Sequence[int]) -> Tensor:
        """The transformer's output in the (unpacked) latent layout."""
        return prediction

    def latents_to_prediction(self, latents: Tensor) -> Tensor:
        """(Unpacked) latents in the layout of the transformer's output: how the training target is laid out."""
        return latents

    def process_condition(
        self, latents: Sequence[Tensor], context: Sequence[dict[str, Tensor]], generator: torch.Generator | None = None
    ) -> ConditionInputs:
        """The flow-matching recipe (module doc): noise levels for the token count of ``patch``, the noisy latents as
        ``transformer_inputs`` lays them out, the target ``noise - x0`` as the transformer outputs it."""
        x0 = torch.stack(list(latents)).to(self.device)
        tokens = math.prod(size // p for size, p in zip(x0.shape[2:], self.patch, strict=True))
        sigmas = self.sampler.sample(x0.shape[0], tokens, generator)
        noisy, target = self.noisy(x0, self.noise_like(x0, generator), sigmas)
        inputs = self.transformer_inputs(noisy, context, sigmas)
        return ConditionInputs(inputs, self.latents_to_prediction(target), sigmas)

    @staticmethod
    def combine_guidance(cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
        """True classifier-free guidance as the pipeline combines its two predictions."""
        return uncond + scale * (cond - uncond)

    @torch.no_grad()
    def vae_mode(self, pixels: Tensor) -> Tensor:
        """The VAE posterior's mode (fp32, with a batch dim of 1) of one sample's pixels in [-1, 1]."""
        vae = self.pipeline.vae
        return vae.encode(pixels[None].to(self.device, vae.dtype)).latent_dist.mode().float()

    def encode_sample(self, pixels: Tensor) -> Tensor:
        """The normalized latents the transformer trains on, of one sample's pixels in [-1, 1] (each model's VAE
        normalization: shift/scale, per-channel mean/std, or scale only)."""
        raise NotImplementedError(f"{type(self).__name__} does not encode samples")

    @torch.no_grad()
    def get_condition(self, inputs: Sequence[str], videos: Sequence[Tensor]) -> dict[str, list]:
        """Each sample's latents and its encoded prompt: what the condition cache stores per sample."""
        if len(inputs) != len(videos):
            raise ValueError(f"get_condition: {len(inputs)} prompts for {len(videos)} samples")
        context = self.encode_prompts(inputs)
        return {"latents": [self.encode_sample(pixels) for pixels in videos], "context": context}

    def decode_latents(self, latents: Tensor) -> Tensor:
        """Pixels in [-1, 1] of (unpacked, normalized) ``latents``: ``(B, 3, H, W)`` images or ``(B, 3, F, H, W)``."""
        raise NotImplementedError(f"{type(self).__name__} has no sampling support")

    def noise_like(self, x: Tensor, generator: torch.Generator | Sequence[torch.Generator] | None) -> Tensor:
        """Standard normal noise of ``x``'s shape; with one generator per sample, sample ``i`` from the ``i``-th."""
        if isinstance(generator, Sequence):
            if len(generator) != x.shape[0]:
                raise ValueError(f"{len(generator)} generators for a batch of {x.shape[0]}")
            noise = torch.stack([torch.randn(x.shape[1:], generator=g, dtype=torch.float32) for g in generator])
        else:
            noise = torch.randn(x.shape, generator=generator, dtype=torch.float32)
        return noise.to(x.device, x.dtype)

    @staticmethod
    def noisy(x0: Tensor, noise: Tensor, sigmas: Tensor) -> tuple[Tensor, Tensor]:
        """``(1 - sigma) x0 + sigma noise`` and the target ``noise - x0``; ``sigmas`` has one entry per sample."""
        s = sigmas.to(x0.device, x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
        return (1 - s) * x0 + s * noise, noise - x0
