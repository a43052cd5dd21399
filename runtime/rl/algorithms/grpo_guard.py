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

Scale (``guard_scale``). The paper's ``s`` and ``-dt`` are each sample's own (``per_sample``, the default).
verl-omni (``trainer/diffusion/diffusion_algos.py``, ``grpo_guard``) takes one scale per micro-batch,
``s = mean_b(std_dev_t) * mean_b(sqrt_dt)``, in both the bias and the rescaling, and one weight
``1 / mean_b(sqrt_dt)^2`` for the micro-batch's mean loss (``verl_omni``). The two agree when a micro-batch holds
one denoising step (verl-omni's layout: its windows are shared by the batch); with Flow-GRPO's per-sample windows a
micro-batch mixes steps and they differ. Both are defensible: per-sample is the paper's Gaussian of each sample's
own step, the shared scale is verl-omni's. Rollout correction's weights multiply each sample's clipped term before
the mean (verl-omni: ``per_elem_loss * rollout_is_weights``); the shared scale stays the whole micro-batch's.

Config: every ``flowgrpo:`` key (same meaning; ``clip_range`` default 2e-6) under ``grpo_guard:``, plus::

    grpo_guard:
      ratio_norm: true           # RatioNorm (bias correction and std rescaling of the log-ratio)
      grad_reweight: true        # per-step loss / (-dt)
      guard_scale: per_sample    # per_sample (the paper's: each sample's s and -dt) | verl_omni (one per micro-batch)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.config.errors import ConfigErrors
from runtime.config.sections import KeyRules
from runtime.rl.algorithms import flowgrpo
from runtime.rl.algorithms.base import Gaussian

if TYPE_CHECKING:
    import torch

    from runtime.rl.config import RLConfig

__all__ = ["ALGORITHM", "GRPOGuard", "RULES", "Settings", "check", "conventions", "guard_loss", "step_objective"]

NAME = "grpo_guard"
GUARD_SCALES = ("per_sample", "verl_omni")  # the first is the paper's (the default)


@dataclass(frozen=True)
class Settings(flowgrpo.Settings):
    clip_range: float = 2e-6
    ratio_norm: bool = True
    grad_reweight: bool = True
    guard_scale: str = "per_sample"


RULES = flowgrpo.rules_as(NAME).merged(KeyRules(choices={f"{NAME}.guard_scale": GUARD_SCALES}))
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
    if config.algo.policy_loss_mode != "vanilla":
        errors.add(
            f"{NAME}.policy_loss_mode: {config.algo.policy_loss_mode!r} is a form of Flow-GRPO's ratio; RatioNorm "
            "rescales each step's ratio by that step's std; no sequence-level form of it is defined; remove the key"
        )
    errors.raise_if_any()


def conventions(settings: Settings) -> str:
    parts = [
        flowgrpo.conventions(settings),
        f"RatioNorm {'on' if settings.ratio_norm else 'off'}",
        f"gradient reweighting 1/(-dt) {'on' if settings.grad_reweight else 'off'}",
        {
            "per_sample": "scale and weight per sample (the paper's)",
            "verl_omni": "one scale mean(std_dev_t) x mean(sqrt_dt) and weight 1/mean(sqrt_dt)^2 per micro-batch "
            "(verl-omni's)",
        }[settings.guard_scale],
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
    adv_clip_max: float | None,
    ratio_norm: bool = True,
    grad_reweight: bool = True,
    guard_scale: str = "per_sample",
    weights: torch.Tensor | None = None,
    ratio_std_ddof: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The regulated clipped loss of one step (module docstring) and its statistics (detached). ``weights``: each
    sample's clipped term times its weight before the mean; ``verl_omni``'s scale is still the whole micro-batch's."""
    import torch

    from runtime.rl.algorithms.objectives import ratio_stats, weighted_mean

    if guard_scale not in GUARD_SCALES:
        raise ValueError(f"guard_scale: expected one of {GUARD_SCALES}, found {guard_scale!r}")
    b = log_prob.shape[0]
    if guard_scale == "per_sample":
        s = (std_dev_t * sqrt_dt).reshape(b).to(log_prob.dtype)
        dt = sqrt_dt.reshape(b).to(log_prob.dtype) ** 2
    else:  # verl-omni: one scale and one weight for the micro-batch
        s = (std_dev_t.mean() * sqrt_dt.mean()).to(log_prob.dtype).expand(b)
        dt = (sqrt_dt.mean() ** 2).to(log_prob.dtype).expand(b)
    dims = tuple(range(1, mean.ndim))
    bias = ((mean - old_mean.detach()) ** 2).mean(dim=dims).to(log_prob.dtype) / (2 * s**2)
    log_ratio = log_prob - old_log_prob.detach()
    if ratio_norm:
        log_ratio = (log_ratio + bias) * s
    ratio = torch.exp(log_ratio)
    adv = advantage.to(log_prob.dtype)
    if adv_clip_max is not None:
        adv = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    per_sample = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range))
    if grad_reweight:
        per_sample = per_sample / dt
    loss = weighted_mean(per_sample, weights)
    stats = {
        "policy_loss": loss.detach(),
        "clip_fraction": ((ratio.detach() - 1.0).abs() > clip_range).float().mean(),
        "approx_kl": 0.5 * ((log_prob - old_log_prob).detach() ** 2).mean(),
        "guard/ratio_mean": ratio.detach().mean(),
        "guard/ratio_mean_bias": bias.detach().mean(),
        **ratio_stats(ratio, clip_range, ratio_std_ddof),  # of the normalised ratio: the one the clip acts on
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
    weights: torch.Tensor | None = None,
    kl_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one window step of a micro-batch (before the share scaling) and its statistics.

    ``gaussian``: ``(mean, old_mean, std_dev_t, sqrt_dt)`` of the step; ``kl_terms``, ``weights`` and
    ``kl_weights`` as Flow-GRPO's."""
    from runtime.rl.algorithms.objectives import kl_to_reference

    loss, stats = guard_loss(
        log_prob,
        old_log_prob,
        advantage,
        *gaussian,
        clip_range=settings.clip_range,
        adv_clip_max=settings.adv_clip_max,
        ratio_norm=settings.ratio_norm,
        grad_reweight=settings.grad_reweight,
        guard_scale=settings.guard_scale,
        weights=weights,
        ratio_std_ddof=settings.ratio_std_ddof,
    )
    if kl_terms is not None:
        kl = kl_to_reference(*kl_terms, settings.kl_form, kl_weights)
        loss = loss + settings.kl_coef * kl
        stats["kl"] = kl.detach()
    return loss, stats


class GRPOGuard(flowgrpo.FlowGRPO):
    """Flow-GRPO's sampling with the regulated objective, which reads the pre-update step means."""

    name = NAME
    Settings = Settings
    rules = RULES
    needs_old_mean = True

    def check(self, config: RLConfig) -> None:
        check(config)

    def conventions(self, settings: Settings) -> str:
        return conventions(settings)

    def step_objective(
        self,
        settings: Settings,
        log_prob: torch.Tensor,
        old_log_prob: torch.Tensor,
        advantage: torch.Tensor,
        kl_terms: Gaussian | None,
        gaussian: Gaussian | None = None,
        seq_log_ratio: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        kl_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert gaussian is not None, "needs_old_mean: the loop passes the step's Gaussian"
        return step_objective(
            settings,
            log_prob,
            old_log_prob,
            advantage,
            kl_terms,
            gaussian=gaussian,
            weights=weights,
            kl_weights=kl_weights,
        )


ALGORITHM = GRPOGuard()
