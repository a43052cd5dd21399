"""The Flow-GRPO adapter for diffusers' ``SD3Transformer2DModel`` (true CFG), registered as
``"SD3Transformer2DModel"`` (every algorithm's).

A batch is a dict of fp32 tensors: ``prompt_embeds`` ``[B, L, D]``, ``pooled_prompt_embeds`` ``[B, P]`` and, when
``guidance_scale > 1``, ``negative_prompt_embeds`` / ``negative_pooled_prompt_embeds`` of the same shapes. True CFG
runs the module once on ``[uncond; cond]`` (2B rows) and combines ``v = v_u + g (v_c - v_u)``. The rollout
(``runtime.rl.sampling.rollout``) and the training recomputation both go through ``step``, so the two cannot differ in
how they build inputs or take the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from torch import nn

from runtime.rl.adapters.registry import VelocityAdapter, register_diffusion_model
from runtime.rl.sampling.scheduler import FlowMatchSchedule, SdeMethod, make_schedule

__all__ = ["SD3FlowGRPO"]


@register_diffusion_model("SD3Transformer2DModel")
class SD3FlowGRPO(VelocityAdapter):
    def __init__(
        self,
        scheduler_config: Mapping[str, Any] | None = None,
        *,
        guidance_scale: float = 4.5,
        noise_level: float = 0.7,
        method: SdeMethod = "sde",
    ):
        self.scheduler_config = dict(scheduler_config or {"shift": 3.0})
        self.guidance_scale = guidance_scale
        self.noise_level = noise_level
        self.method: SdeMethod = method

    @property
    def do_cfg(self) -> bool:
        return self.guidance_scale > 1.0

    def build_scheduler(self, config: Mapping[str, Any] | None = None) -> FlowMatchEulerDiscreteScheduler:
        return FlowMatchEulerDiscreteScheduler.from_config(dict(config or self.scheduler_config))

    def set_timesteps(self, num_inference_steps: int, *, mu: float | None = None, **kwargs: Any) -> FlowMatchSchedule:
        return make_schedule(self.scheduler_config, num_inference_steps, mu=mu, **kwargs)

    def prepare_model_inputs(
        self, batch: dict[str, Any], latents: torch.Tensor, step_index: int | torch.Tensor
    ) -> dict[str, Any]:
        schedule: FlowMatchSchedule = batch["schedule"]
        b = latents.shape[0]
        index = torch.as_tensor(step_index, dtype=torch.long, device=latents.device)
        timestep = schedule.timesteps.to(latents.device)[index]
        if timestep.ndim == 0:
            timestep = timestep.expand(b)
        embeds, pooled = batch["prompt_embeds"], batch["pooled_prompt_embeds"]
        if self.do_cfg:
            latents = torch.cat([latents, latents])
            embeds = torch.cat([batch["negative_prompt_embeds"], embeds])
            pooled = torch.cat([batch["negative_pooled_prompt_embeds"], pooled])
            timestep = torch.cat([timestep, timestep])
        return {
            "hidden_states": latents,
            "encoder_hidden_states": embeds,
            "pooled_projections": pooled,
            "timestep": timestep,
            "return_dict": False,
        }

    def velocity(
        self, module: nn.Module, batch: dict[str, Any], latents: torch.Tensor, step_index: int | torch.Tensor
    ) -> torch.Tensor:
        out = module(**self.prepare_model_inputs(batch, latents, step_index))[0]
        if self.do_cfg:
            uncond, cond = out.chunk(2)
            out = uncond + self.guidance_scale * (cond - uncond)
        return out
