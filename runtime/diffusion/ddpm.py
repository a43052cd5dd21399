"""The DDPM training objective of the noise-prediction DiTs (PixArt-Alpha/Sigma, the class-conditional DiT family):
integer timesteps, the scheduler's forward process, the noise (or velocity) as target, and the learned-variance
channels such transformers output beside it.

Noise schedule (the pipeline's scheduler config, e.g. PixArt-Sigma's ``beta_schedule = "linear"``, ``beta_start =
1e-4``, ``beta_end = 0.02``, ``num_train_timesteps = T = 1000``)::

    beta_t                                             t = 0 .. T-1 (DDPMScheduler's betas for that config)
    abar_t  = prod_{s <= t} (1 - beta_s)               (alphas_cumprod)
    x_t     = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps   (DDPMScheduler.add_noise), eps ~ N(0, I)

Timesteps: ``t = floor(u T)`` (at most ``T - 1``) for ``u`` from the condition model's ``TimestepSampler`` (uniform by
default: diffusers' ``torch.randint(0, T)``, drawn from each sample's own generator).

Target, by the scheduler's ``prediction_type``: ``epsilon``: ``eps``; ``v_prediction``:
``v = sqrt(abar_t) eps - sqrt(1 - abar_t) x0`` (DDPMScheduler.get_velocity). Others (``sample``) are refused.

Learned variance: a transformer with ``out_channels == 2 * in_channels`` outputs ``[eps_hat, v_hat]`` along the
channels, ``v_hat`` interpolating the log-variance between ``beta_t`` and the posterior's ``tilde beta_t``
(Nichol & Dhariwal 2021). diffusers' training scripts for these models (the PixArt trainers in
``examples/research_projects/pixart``: ``model_pred.chunk(2, dim=1)[0]``, then the MSE against the target) train
the first half only, and so does this objective: the target is laid out like the output, the noise in the first
``C`` channels, and the loss mask (``ConditionInputs.loss_mask``, read by the trainer's loss) keeps those ``C``
channels, so each sample's loss is ``mean over the first C channels of (eps_hat - eps)^2`` and the variance channels
get no gradient (they keep the values loaded; the pipelines' schedulers read only the first half too). The original
PixArt / DiT recipe's extra ``L_vlb`` term (weight 1/1000, stop-gradient on the mean) that trains ``v_hat`` is not
part of it. Loss weight 1 per sample (diffusers' scripts without ``snr_gamma``); the noise level reported per sample
(``ConditionInputs.sigmas``) is ``sqrt(1 - abar_t)``, the noise's standard deviation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["PREDICTION_TYPES", "DDPMObjective"]

PREDICTION_TYPES = ("epsilon", "v_prediction")


@dataclass
class DDPMObjective:
    """Timesteps, noisy latents and target of the DDPM recipe (module doc) for one pipeline's scheduler config."""

    scheduler: Any  # diffusers.DDPMScheduler: the forward process the scheduler config defines
    latent_channels: int
    learned_variance: bool

    @classmethod
    def from_configs(
        cls, scheduler_config: Any, transformer_config: dict[str, Any], where: str = "scheduler/scheduler_config.json"
    ) -> DDPMObjective:
        """The objective of a pipeline whose scheduler (any diffusers scheduler with DDPM's beta settings, e.g.
        PixArt's DPM-Solver) has ``scheduler_config`` and whose transformer has ``transformer_config``."""
        from diffusers import DDPMScheduler

        prediction = scheduler_config.get("prediction_type", "epsilon")
        if prediction not in PREDICTION_TYPES:
            raise ValueError(
                f"{where}: prediction_type {prediction!r} is not trained here; expected one of "
                f"{', '.join(PREDICTION_TYPES)} (set it in the pipeline's scheduler config)"
            )
        channels = transformer_config.get("in_channels", 4)
        out = transformer_config.get("out_channels") or channels
        return cls(DDPMScheduler.from_config(dict(scheduler_config)), channels, out == 2 * channels)

    @property
    def num_train_timesteps(self) -> int:
        return self.scheduler.config.num_train_timesteps

    @property
    def prediction_type(self) -> str:
        return self.scheduler.config.prediction_type

    def timesteps(self, u: Tensor) -> Tensor:
        """``floor(u T)``, at most ``T - 1``, as int64 (one per sample)."""
        t = self.num_train_timesteps
        return (u * t).long().clamp(max=t - 1)

    def noise_std(self, timesteps: Tensor) -> Tensor:
        """``sqrt(1 - abar_t)`` per sample (float32)."""
        alphas = self.scheduler.alphas_cumprod.to(timesteps.device, torch.float32)[timesteps]
        return (1 - alphas).sqrt()

    def noisy_and_target(self, x0: Tensor, noise: Tensor, timesteps: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """``x_t``, the target laid out like the transformer's output, and the loss mask (None without a learned
        variance: every output channel is trained)."""
        noisy = self.scheduler.add_noise(x0, noise, timesteps)
        target = noise if self.prediction_type == "epsilon" else self.scheduler.get_velocity(x0, noise, timesteps)
        if not self.learned_variance:
            return noisy, target, None
        target = torch.cat([target, torch.zeros_like(target)], dim=1)
        mask = torch.cat([torch.ones_like(noise), torch.zeros_like(noise)], dim=1)
        return noisy, target, mask

    def predicted(self, output: Tensor) -> Tensor:
        """The trained half of a transformer output (the noise or velocity channels), as the pipelines take it."""
        return output[:, : self.latent_channels] if self.learned_variance else output
