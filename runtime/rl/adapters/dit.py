"""The Flow-GRPO adapter of every generated DiT (Wan, Flux, Qwen-Image, HunyuanVideo, ...), driven by its condition
model, registered under the upstream class name (``"WanTransformer3DModel"``, ...; every algorithm's).

A DiT needs no adapter code of its own: what differs between models is what its pipeline does, and the condition
model module states exactly that (``runtime/diffusion/conditions/base.py``, "Sampling"): the latent shape of a
pixel size, the arguments of the pipeline's ``scheduler.set_timesteps`` call (its ``sigmas`` and resolution shift
``mu``, passed to ``make_schedule`` explicitly, so the rollout's schedule is the pipeline's), the prompt context,
the transformer's inputs at a noise level, how its output unpacks and how true CFG combines.

A batch is ``{"context": [per-sample dicts], "negative_context": [...] or absent}`` (``encode``); the rollout adds
the schedule. The state the SDE steps is the unpacked latent (what the VAE decodes); the transformer sees it
packed. Guidance:

* ``true_cfg_scale > 1``: the negative-prompt branch and the conditional one run as one batch
  ``[negative; conditional]`` and are combined in the transformer's output layout by the pipeline's own rule
  (``combine_guidance``: Qwen-Image rescales to the conditional prediction's norm per token);
* a guidance-distilled transformer (Flux.1-dev) takes its guidance as an input: the condition model's
  ``guidance_scale`` option (``dit.condition``), not a second branch.

Rollout and training call the same ``step`` (``VelocityAdapter``), so their log-probs agree bitwise for the same
batch layout.

A pipeline with two transformers switched at ``boundary_ratio`` (Wan2.2 A14B): ``experts`` (``runtime/rl/experts.py``)
picks each step's module as ``WanPipeline`` does: the module passed on the trained expert's steps, the frozen other
expert on the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from runtime.rl.adapters.registry import VelocityAdapter, is_registered, register_diffusion_model
from runtime.rl.sampling.scheduler import CpsLogProb, FlowMatchSchedule, SdeMethod, make_schedule

__all__ = ["DiTFlowGRPO", "adapter_for", "register_adapters"]


class DiTFlowGRPO(VelocityAdapter):
    """Flow-GRPO on a generated DiT: ``condition_model`` (frozen, with its encoders) states the pipeline's facts."""

    model_type: ClassVar[str] = ""
    experts: Any = None  # runtime.rl.experts.ExpertSwitch of a pipeline with two experts, else None

    def __init__(
        self,
        condition_model: Any,
        latent_shape: Sequence[int],
        *,
        true_cfg_scale: float = 1.0,
        true_cfg_scale_2: float | None = None,
        noise_level: float = 0.7,
        method: SdeMethod = "sde",
        cps_log_prob: CpsLogProb = "squared_error",
    ):
        self.condition_model = condition_model
        self.latent_shape = tuple(latent_shape)
        self.true_cfg_scale = float(true_cfg_scale)
        # two experts: WanPipeline's guidance_scale_2 on transformer_2's (low-noise) steps
        self.true_cfg_scale_2 = self.true_cfg_scale if true_cfg_scale_2 is None else float(true_cfg_scale_2)
        self.noise_level = noise_level
        self.method: SdeMethod = method
        self.cps_log_prob: CpsLogProb = cps_log_prob

    @property
    def do_true_cfg(self) -> bool:
        return self.true_cfg_scale > 1.0

    def build_scheduler(self, config: Any = None) -> Any:
        return self.condition_model.pipeline.scheduler

    def set_timesteps(self, num_inference_steps: int, **kwargs: Any) -> FlowMatchSchedule:
        """The pipeline's schedule: its scheduler's config with the ``sigmas`` / ``mu`` the pipeline passes."""
        facts = self.condition_model.sampling_schedule(num_inference_steps, self.latent_shape)
        return make_schedule(self.build_scheduler(), num_inference_steps, **facts, **kwargs)

    def encode(self, prompts: Sequence[str], negative_prompt: str | None = None) -> dict[str, Any]:
        """The batch of ``prompts``: each one's context, and the negative prompt's under true CFG. Each prompt is
        encoded alone, so its context does not depend on the prompts it is batched with (a replica holding one
        prompt encodes it exactly as one process holding two); the negative prompt's is kept between calls."""
        encode = self.condition_model.encode_prompts
        batch: dict[str, Any] = {"context": [encode([p])[0] for p in prompts]}
        if self.do_true_cfg:
            key = negative_prompt or ""
            if getattr(self, "_negative", (None, None))[0] != key:  # as the pipeline encodes its negative prompt
                self._negative = (key, self.condition_model.encode_negative_prompts([key])[0])
            batch["negative_context"] = [self._negative[1]] * len(prompts)
        return batch

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] of final latents (what rewards score)."""
        return self.condition_model.decode_latents(latents)

    def prepare_model_inputs(
        self, batch: dict[str, Any], latents: torch.Tensor, step_index: int | torch.Tensor
    ) -> dict[str, Any]:
        schedule: FlowMatchSchedule = batch["schedule"]
        index = torch.as_tensor(step_index, dtype=torch.long, device=latents.device)
        sigmas = schedule.sigmas.to(latents.device)[index]
        if sigmas.ndim == 0:
            sigmas = sigmas.expand(latents.shape[0])
        context = list(batch["context"])
        if self.do_true_cfg:
            latents, sigmas = torch.cat([latents, latents]), torch.cat([sigmas, sigmas])
            context = list(batch["negative_context"]) + context
        inputs = self.condition_model.transformer_inputs(latents, context, sigmas)
        return {**inputs, "return_dict": False}

    def velocity(
        self, module: nn.Module, batch: dict[str, Any], latents: torch.Tensor, step_index: int | torch.Tensor
    ) -> torch.Tensor:
        scale = self.true_cfg_scale
        if self.experts is not None:  # the pipeline's expert of this step, and its guidance scale
            chosen = self.experts.module_at(module, batch["schedule"], step_index)
            if (chosen is module) == (self.experts.expert == "transformer_2"):
                scale = self.true_cfg_scale_2
            module = chosen
        out = module(**self.prepare_model_inputs(batch, latents, step_index))[0]
        if self.do_true_cfg:
            uncond, cond = out.chunk(2)
            out = self.condition_model.combine_guidance(cond, uncond, scale)
        return self.condition_model.prediction_to_latents(out, latents.shape[1:])


_ADAPTERS: dict[str, type[DiTFlowGRPO]] = {}  # model type -> its adapter class


def register_adapters() -> None:
    """One ``DiTFlowGRPO`` subclass per generated DiT, registered under its upstream class name unless an adapter of
    its own holds that name (the library's SD3 adapter: ``adapter_for`` still finds the generated one). Called by the
    registry when it loads the built-in adapters."""
    from runtime.diffusion.registry import dit_model_types, lookup_dit

    for model_type in dit_model_types():
        if model_type in _ADAPTERS:
            continue
        architecture = lookup_dit(model_type).upstream_auto
        cls = type(f"{architecture}FlowGRPO", (DiTFlowGRPO,), {"model_type": model_type, "__module__": __name__})
        _ADAPTERS[model_type] = cls
        if not is_registered(architecture):
            register_diffusion_model(architecture)(cls)


def adapter_for(model_type: str) -> type[DiTFlowGRPO]:
    """The adapter class of the generated DiT ``model_type``."""
    from runtime.diffusion.registry import dit_model_types
    from runtime.rl.adapters.registry import registered_diffusion_models

    registered_diffusion_models()  # loads the built-in adapters, then registers the generated DiTs
    if model_type not in _ADAPTERS:
        raise KeyError(f"{model_type!r} is not a generated DiT; known: {', '.join(dit_model_types())}")
    return _ADAPTERS[model_type]
