"""The RL adapter of ``"BagelMoT"`` (every algorithm's) of ``BagelMoT``: BAGEL's sampler.

The adapter follows BAGEL's own sampler (``Bagel.generate_image`` / ``_forward_flow``, its inferencer's defaults):

* schedule: ``t = linspace(1, 0, N + 1)`` shifted by ``t' = s t / (1 + (s - 1) t)`` (``timestep_shift`` s = 3),
  built by ``make_schedule`` (diffusers' static shift is the same formula) from those unshifted sigmas;
* CFG branches that share one layout and differ only in masks: ``full`` (text and condition image), ``cfg_text``
  (the text hidden, the condition image KEPT: BAGEL's text-free context still holds the image), ``cfg_img`` (the
  image hidden, the text kept; only with a condition image), run as one batch;
* their combination, its renormalisation and its interval gating as ``bagel_guidance`` states.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from torch import nn

from runtime.rl.adapters.bagel.checkpoint import bagel_new_token_ids, bagel_prompt_ids
from runtime.rl.adapters.bagel.model import BagelMoT
from runtime.rl.adapters.registry import VelocityAdapter, register_diffusion_model
from runtime.rl.sampling.scheduler import FlowMatchSchedule, SdeMethod, make_schedule

__all__ = ["BagelMoTFlowGRPO", "CFG_RENORM_TYPES", "bagel_guidance", "bagel_sigmas"]

CFG_RENORM_TYPES = ("global", "channel", "text_channel")


def bagel_sigmas(num_inference_steps: int) -> list[float]:
    """BAGEL's unshifted timesteps ``linspace(1, 0, N + 1)`` without the final 0 (``make_schedule`` appends it)."""
    return [1.0 - k / num_inference_steps for k in range(num_inference_steps)]


def bagel_guidance(
    v: torch.Tensor,
    v_cfg_text: torch.Tensor,
    v_cfg_img: torch.Tensor | None,
    sigma: torch.Tensor | float,
    *,
    text_scale: float,
    image_scale: float = 1.0,
    interval: tuple[float, float] = (0.4, 1.0),
    renorm_min: float = 0.0,
    renorm_type: str = "global",
    patch_size: int = 1,
) -> torch.Tensor:
    """BAGEL's 3-branch CFG, per sample (``v``: the full branch; ``v_cfg_text``: the text hidden; ``v_cfg_img``: the
    image hidden, or None without a condition image, where BAGEL's image-free context is the full one).

    Guidance applies where ``interval[0] < sigma <= interval[1]`` (the low edge excluded, as BAGEL) and only when
    ``text_scale > 1`` (BAGEL skips every branch otherwise); elsewhere the result is ``v``. Inside::

        "global" / "channel":
            v_text = v_cfg_text + text_scale (v - v_cfg_text)
            v'     = v_cfg_img + image_scale (v_text - v_cfg_img)        if image_scale > 1, else v_text
            v'    *= clamp(||v|| / (||v'|| + 1e-8), renorm_min, 1)      norms over the sample ("global") or per
                                                                         token over the channels ("channel")
        "text_channel":
            v_text = (v_cfg_text + text_scale (v - v_cfg_text)) * clamp(||v||_c / (||.||_c + 1e-8), renorm_min, 1)
            v'     = v_cfg_img + image_scale (v_text - v_cfg_img)        if image_scale > 1, else v_text

    ``||.||_c`` is the norm over each token's values, as BAGEL's packed tokens carry them: the ``C x p x p`` values of
    a ``patch_size`` p patch of a ``[B, C, H, W]`` latent. Computed in fp32.
    """
    if renorm_type not in CFG_RENORM_TYPES:
        raise ValueError(f"unknown cfg_renorm_type {renorm_type!r}; expected one of {', '.join(CFG_RENORM_TYPES)}")
    v, v_text_free = v.float(), v_cfg_text.float()
    v_image_free = v if v_cfg_img is None else v_cfg_img.float()
    b = v.shape[0]
    shape = (b,) + (1,) * (v.ndim - 1)
    s = torch.as_tensor(sigma, dtype=torch.float32, device=v.device).reshape(-1).expand(b)
    inside = ((s > interval[0]) & (s <= interval[1])).reshape(shape)
    if text_scale <= 1.0:
        return v

    def norm(x: torch.Tensor, channel: bool) -> torch.Tensor:
        """Per token (its C x p x p values) or over the whole sample, broadcastable against ``x``."""
        if not channel:
            return torch.linalg.vector_norm(x, dim=tuple(range(1, x.ndim)), keepdim=True)
        c, h, w = x.shape[1:]
        p = patch_size
        tokens = x.reshape(b, c, h // p, p, w // p, p)
        n = torch.linalg.vector_norm(tokens, dim=(1, 3, 5), keepdim=True)
        return n.expand_as(tokens).reshape(x.shape)

    v_text = v_text_free + text_scale * (v - v_text_free)
    if renorm_type == "text_channel":
        v_text = v_text * (norm(v, True) / (norm(v_text, True) + 1e-8)).clamp(min=renorm_min, max=1.0)
        guided = v_image_free + image_scale * (v_text - v_image_free) if image_scale > 1.0 else v_text
    else:
        guided = v_image_free + image_scale * (v_text - v_image_free) if image_scale > 1.0 else v_text
        channel = renorm_type == "channel"
        guided = guided * (norm(v, channel) / (norm(guided, channel) + 1e-8)).clamp(min=renorm_min, max=1.0)
    return torch.where(inside, guided, v)


@register_diffusion_model("BagelMoT")
class BagelMoTFlowGRPO(VelocityAdapter):
    """Batch keys: ``input_ids`` ``[B, L]`` long (``bagel_prompt_ids``: BAGEL's bos/eos around the prompt's tokens),
    optional ``attention_mask`` ``[B, L]``, optional ``cond_latents`` ``[B, C, H, W]`` (a clean condition-image
    latent: the image branch). Defaults are BAGEL's inferencer's."""

    module_class: ClassVar[type] = BagelMoT

    def __init__(
        self,
        *,
        timestep_shift: float = 3.0,
        text_guidance_scale: float = 4.0,
        image_guidance_scale: float = 1.5,
        cfg_interval: tuple[float, float] = (0.4, 1.0),
        cfg_renorm_min: float = 0.0,
        cfg_renorm_type: str = "global",
        noise_level: float = 0.7,
        method: SdeMethod = "sde",
    ):
        if cfg_renorm_type not in CFG_RENORM_TYPES:
            raise ValueError(f"unknown cfg_renorm_type {cfg_renorm_type!r}; expected one of {CFG_RENORM_TYPES}")
        self.timestep_shift = float(timestep_shift)
        self.text_guidance_scale = text_guidance_scale
        self.image_guidance_scale = image_guidance_scale
        self.cfg_interval = tuple(cfg_interval)
        self.cfg_renorm_min = cfg_renorm_min
        self.cfg_renorm_type = cfg_renorm_type
        self.noise_level = noise_level
        self.method: SdeMethod = method

    @property
    def do_cfg(self) -> bool:
        return self.text_guidance_scale > 1.0

    # ---- sampling from prompts (the RL job): BAGEL's tokenization, the VAE -----------------------------------------

    def bind(self, tokenizer: Any, vae: Any, latent_shape: Sequence[int]) -> BagelMoTFlowGRPO:
        """Attach what sampling from prompts needs: the checkpoint's tokenizer (with BAGEL's special tokens), its VAE
        (a diffusers ``AutoencoderKL``: latents are ``(z - shift_factor) * scaling_factor``) and one sample's latent
        shape ``(C, H, W)``."""
        self.tokenizer, self.vae, self.latent_shape = tokenizer, vae, tuple(latent_shape)
        self.new_token_ids = bagel_new_token_ids(tokenizer)
        return self

    def encode(self, prompts: Sequence[str], negative_prompt: str | None = None) -> dict[str, Any]:
        """``input_ids`` (``bagel_prompt_ids`` of each prompt, right-padded) and ``attention_mask``. BAGEL's
        text-free branch hides the text (no negative prompt)."""
        rows = [bagel_prompt_ids(self.tokenizer, p, self.new_token_ids) for p in prompts]
        longest = max(len(r) for r in rows)
        ids = torch.full((len(rows), longest), self.new_token_ids["eos_token_id"], dtype=torch.long)
        mask = torch.zeros(len(rows), longest, dtype=torch.bool)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = True
        return {"input_ids": ids, "attention_mask": mask}

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] of final latents."""
        config = self.vae.config
        x = latents.float() / config.scaling_factor + (config.shift_factor or 0.0)
        device = next(self.vae.parameters()).device
        return self.vae.decode(x.to(device, self.vae.dtype), return_dict=False)[0].float().clamp(-1, 1)

    def build_scheduler(self, config: Mapping[str, Any] | None = None) -> FlowMatchEulerDiscreteScheduler:
        return FlowMatchEulerDiscreteScheduler.from_config(dict(config or {"shift": self.timestep_shift}))

    def set_timesteps(self, num_inference_steps: int, **kwargs: Any) -> FlowMatchSchedule:
        """BAGEL's schedule: ``linspace(1, 0, N + 1)`` with its time shift (see the module docstring)."""
        sigmas = bagel_sigmas(num_inference_steps)
        return make_schedule(self.build_scheduler(), num_inference_steps, sigmas=sigmas, **kwargs)

    def _sigma(self, batch: dict[str, Any], latents: torch.Tensor, step_index: int | torch.Tensor) -> torch.Tensor:
        index = torch.as_tensor(step_index, dtype=torch.long, device=latents.device)
        sigma = batch["schedule"].sigmas.to(latents.device)[index]
        return sigma.expand(latents.shape[0]) if sigma.ndim == 0 else sigma

    def _image_branch(self, batch: dict[str, Any]) -> bool:
        return batch.get("cond_latents") is not None and self.image_guidance_scale > 1.0

    def prepare_model_inputs(
        self, batch: dict[str, Any], latents: torch.Tensor, step_index: int | torch.Tensor
    ) -> dict[str, Any]:
        """Rows ``[cfg_text; cfg_img; full]`` (``cfg_img`` only with a condition image and an image scale > 1), or
        the full branch alone without CFG. All branches share one layout; the masks hide the text / the image."""
        b = latents.shape[0]
        ids = batch["input_ids"]
        text_mask = batch.get("attention_mask")
        text_mask = torch.ones_like(ids, dtype=torch.bool) if text_mask is None else text_mask.bool()
        cond = batch.get("cond_latents")
        sigma = self._sigma(batch, latents, step_index)
        has_img = cond is not None
        yes = torch.ones(b, dtype=torch.bool, device=latents.device)
        branches = [(text_mask, yes)]
        if self.do_cfg:
            branches = [(torch.zeros_like(text_mask), yes)]  # cfg_text: the text hidden, the image kept
            if self._image_branch(batch):
                branches.append((text_mask, ~yes))  # cfg_img: the image hidden
            branches.append((text_mask, yes))
        k = len(branches)
        return {
            "input_ids": ids.repeat(k, 1),
            "latents": latents.repeat(k, *([1] * (latents.ndim - 1))),
            "timestep": sigma.repeat(k),
            "text_mask": torch.cat([m for m, _ in branches]),
            "cond_latents": None if not has_img else cond.repeat(k, *([1] * (cond.ndim - 1))),
            "cond_mask": None if not has_img else torch.cat([c for _, c in branches]),
        }

    def velocity(
        self, module: nn.Module, batch: dict[str, Any], latents: torch.Tensor, step_index: int | torch.Tensor
    ) -> torch.Tensor:
        out = module(**self.prepare_model_inputs(batch, latents, step_index))
        if not self.do_cfg:
            return out
        chunks = out.chunk(3 if self._image_branch(batch) else 2)
        return bagel_guidance(
            chunks[-1],
            chunks[0],
            chunks[1] if len(chunks) == 3 else None,
            self._sigma(batch, latents, step_index),
            text_scale=self.text_guidance_scale,
            image_scale=self.image_guidance_scale,
            interval=self.cfg_interval,
            renorm_min=self.cfg_renorm_min,
            renorm_type=self.cfg_renorm_type,
            patch_size=int(getattr(module, "config", {}).get("latent_patch_size", 1)),
        )
