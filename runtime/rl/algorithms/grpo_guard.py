"""GRPO-Guard (Wang et al. 2025, arXiv:2510.22319) as an algorithm of ``runtime.rl``: Flow-GRPO's rollout, window and
advantages with a regulated clipping objective. Everything but the per-step objective is Flow-GRPO's
(``runtime/rl/algorithms/flowgrpo.py``); the section is ``grpo_guard:`` with Flow-GRPO's keys plus two switches.

Why. A Flow-GRPO step is the Gaussian ``N(mu_theta, s^2)`` with ``s = std_dev_t * sqrt(-dt)``; the sample it
scores is ``x = mu_old + s * eps``. Its log importance ratio (per-element mean over the latent, ``Delta = mu_theta -
mu_old``) is::

    log r = mean(eps * Delta) / s  -  mean(Delta^2) / (2 s^2)

The second term is never positive, so the ratio's mean sits below 1 (a left shift that keeps positive-advantage
samples out of the clip region), and the first term's scale ``1 / s`` differs by orders of magnitude between
timesteps, so one ``clip_range`` cannot fit every step. The paper calls the result implicit over-optimisation: the
proxy reward rises while image quality and prompt alignment fall.

RatioNorm (``ratio_norm: true``) adds the bias back and rescales by the step's std::

    b_t        = mean(Delta^2) / (2 s^2)
    log r~_t   = (log p_theta - log p_old + b_t) * s        (= mean(eps * Delta): centred, step-independent scale)
    r~_t       = exp(log r~_t)

Gradient reweighting (``grad_reweight: true``) divides each step's clipped loss by ``-dt = sigma_t - sigma_{t+1}``,
which equalises the gradient magnitude across noise levels::

    L_t = mean_b( max(-A_b r~_b, -A_b clip(r~_b, 1 - clip_range, 1 + clip_range)) / (-dt_b) )

``mu_old`` is the policy's mean before this iteration's first update: the first inner epoch's recomputed mean
(the policy has not moved yet; equal to the rollout's in the rollout's layout), kept for the later inner epochs. On
the first inner epoch ``Delta = 0``, so ``b_t`` is 0 and has no gradient. The normalised log-ratio is ~``s`` times
Flow-GRPO's, hence the much smaller default ``clip_range`` (2e-6, verl-omni's recipe value). ``sde_type`` is ``sde``
only (the rescaling is defined for its ``s``).

Config: every ``flowgrpo:`` key (same meaning; ``clip_range`` default 2e-6) under ``grpo_guard:``, plus::

    grpo_guard:
      ratio_norm: true           # RatioNorm (bias correction and std rescaling of the log-ratio)
      grad_reweight: true        # per-step loss / (-dt)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.config.errors import ConfigErrors
from runtime.rl.algorithms import flowgrpo

if TYPE_CHECKING:
    import torch

    from runtime.rl.config import RLConfig

__all__ = ["NEEDS_OLD_MEAN", "RULES", "Settings", "check", "conventions", "guard_loss", "step_objective", "window"]

NAME = "grpo_guard"
NEEDS_OLD_MEAN = True  # the loop passes (mean, old_mean, std_dev_t, sqrt_dt) to step_objective as ``gaussian``


@dataclass(frozen=True)
class Settings(flowgrpo.Settings):
    clip_range: float = 2e-6
    ratio_norm: bool = True
    grad_reweight: bool = True


RULES = flowgrpo.rules_as(NAME)
window = flowgrpo.window
advantages = flowgrpo.advantages


def check(config: RLConfig) -> None:
    """Flow-GRPO's checks under this section's name, and the SDE type the rescaling is defined for."""
    errors = ConfigErrors()
    errors.run(lambda: flowgrpo.check_as(NAME, config))
    if config.algo.sde_type != "sde":
        errors.add(
            f"{NAME}.sde_type: GRPO-Guard rescales by the 'sde' step's std; found {config.algo.sde_type!r}; "
            "remove the key or use algorithm: flowgrpo for cps"
        )
    errors.raise_if_any()


def conventions(settings: Settings) -> str:
    parts = [
        flowgrpo.conventions(settings),
        f"RatioNorm {'on' if settings.ratio_norm else 'off'}",
        f"gradient reweighting 1/(-dt) {'on' if settings.grad_reweight else 'off'}",
    ]
    return ", ".join(parts)


def guard_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantage: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std_dev_t: torch.Tensor,
    sqrt_dt: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
    ratio_norm: bool = True,
    grad_reweight: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The regulated clipped loss of one step (module docstring) and its statistics (detached)."""
    import torch

    b = log_prob.shape[0]
    s = (std_dev_t * sqrt_dt).reshape(b).to(log_prob.dtype)
    dims = tuple(range(1, mean.ndim))
    bias = ((mean - old_mean.detach()) ** 2).mean(dim=dims).to(log_prob.dtype) / (2 * s**2)
    log_ratio = log_prob - old_log_prob.detach()
    if ratio_norm:
        log_ratio = (log_ratio + bias) * s
    ratio = torch.exp(log_ratio)
    adv = torch.clamp(advantage.to(log_prob.dtype), -adv_clip_max, adv_clip_max)
    per_sample = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range))
    if grad_reweight:
        per_sample = per_sample / sqrt_dt.reshape(b).to(log_prob.dtype) ** 2
    loss = per_sample.mean()
    stats = {
        "policy_loss": loss.detach(),
        "clip_fraction": ((ratio.detach() - 1.0).abs() > clip_range).float().mean(),
        "approx_kl": 0.5 * ((log_prob - old_log_prob).detach() ** 2).mean(),
        "guard/ratio_mean": ratio.detach().mean(),
        "guard/ratio_mean_bias": bias.detach().mean(),
    }
    return loss, stats


def step_objective(
    settings: Settings,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantage: torch.Tensor,
    kl_terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    *,
    gaussian: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one window step of a micro-batch (before the share scaling) and its statistics.

    ``gaussian``: ``(mean, old_mean, std_dev_t, sqrt_dt)`` of the step; ``kl_terms`` as Flow-GRPO's."""
    from runtime.flowgrpo.algorithm import kl_to_reference

    loss, stats = guard_loss(
        log_prob,
        old_log_prob,
        advantage,
        *gaussian,
        clip_range=settings.clip_range,
        adv_clip_max=settings.adv_clip_max,
        ratio_norm=settings.ratio_norm,
        grad_reweight=settings.grad_reweight,
    )
    if kl_terms is not None:
        kl = kl_to_reference(*kl_terms, settings.kl_form)
        loss = loss + settings.kl_coef * kl
        stats["kl"] = kl.detach()
    return loss, stats
