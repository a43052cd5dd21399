"""Flow-DPPO (divergence proximal policy optimisation for flow models, arXiv:2606.11025) as an algorithm of
``runtime.rl``: Flow-GRPO's rollout, window and advantages with PPO's ratio clip replaced by a divergence mask.
Everything but the per-step objective is Flow-GRPO's (``runtime/rl/algorithms/flowgrpo.py``); the section is
``flowdppo:`` with Flow-GRPO's keys (no ``clip_range``) plus two.

Why. Flow-GRPO's clip is a trust-region proxy read off one sample of a high-dimensional Gaussian step, so its ratio
is noisy. The current and the old policy's steps are Gaussians of the same std ``s = std_dev_t * sqrt(-dt)``, so
their divergence is known exactly from the two means (per-element mean over the latent)::

    D_b = mean((mu_theta - mu_old)^2) / (2 s_b^2)       add_kl_coefficient: true (verl-omni's default)
    D_b = mean((mu_theta - mu_old)^2) / 2               add_kl_coefficient: false (the mean drift alone)

A sample's step is dropped from the loss only when it is outside the trust region AND still moving away from the
old policy in the direction its advantage pushes; corrective updates stay::

    r_b      = exp(log p_theta - log p_old)
    masked_b = D_b >= kl_mask_threshold  and  ((A_b > 0 and r_b > 1) or (A_b < 0 and r_b < 1))
    L        = mean_b( masked_b ? 0 : -A_b * r_b )

The mask is a constant of the step (no gradient flows through ``D`` or the comparisons); ``A`` is not clamped
(verl-omni's ``flow_dppo``; ``adv_clip_max`` clamps it when set). ``mu_old`` is the policy's step mean before this
iteration's first update (GRPO-Guard's, ``needs_old_mean``): with ``inner_epochs: 1`` ``D`` is 0 and the loss is
the unclipped policy gradient; the mask acts from the second inner epoch on (verl-omni, which steps the optimizer
once per mini-batch, reaches it from its second mini-batch). ``sde_type`` is ``sde`` and ``noise_level`` positive
(``s > 0``): the divergence is the "sde" step's.

Config: every ``flowgrpo:`` key but ``clip_range`` (same meaning) under ``flowdppo:``, plus (verl-omni's names and
defaults, ``actor.diffusion_loss.*``)::

    flowdppo:
      kl_mask_threshold: 1.0e-5  # epsilon_D: the divergence from which a step moving away is masked
      add_kl_coefficient: true   # D divided by 2 s^2 (the Gaussian KL) | by 2 (the mean drift)
      adv_clip_max: null         # null: advantages unclamped (verl-omni's) | a bound, as Flow-GRPO's
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.config.errors import ConfigErrors
from runtime.config.sections import KeyRules
from runtime.rl.algorithms import flowgrpo
from runtime.rl.algorithms.base import Gaussian

if TYPE_CHECKING:
    import torch

    from runtime.rl.config import RLConfig

__all__ = ["ALGORITHM", "FlowDPPO", "RULES", "Settings", "check", "conventions", "dppo_loss", "step_objective"]

NAME = "flowdppo"


@dataclass(frozen=True)
class Settings(flowgrpo.Settings):
    clip_range: float | None = None  # no ratio clip: refused when set (check)
    adv_clip_max: float | None = None
    kl_mask_threshold: float = 1e-5
    add_kl_coefficient: bool = True


RULES = flowgrpo.rules_as(NAME).merged(KeyRules(positive=frozenset({f"{NAME}.kl_mask_threshold"})))
window = flowgrpo.window
advantages = flowgrpo.advantages


def check(config: RLConfig) -> None:
    """Flow-GRPO's checks under this section's name, and what the divergence needs."""
    errors = ConfigErrors()
    s: Settings = config.algo
    errors.run(lambda: flowgrpo.check_as(NAME, config))
    if s.clip_range is not None:
        errors.add(f"{NAME}.clip_range: Flow-DPPO has no ratio clip (kl_mask_threshold bounds the update); remove it")
    if s.sde_type != "sde":
        errors.add(
            f"{NAME}.sde_type: the divergence is the 'sde' step's Gaussian KL; found {s.sde_type!r}; "
            "remove the key or use algorithm: flowgrpo for cps"
        )
    if s.add_kl_coefficient and s.noise_level == 0:
        errors.add(f"{NAME}.noise_level: 0 makes every step deterministic (s = 0): the divergence D divides by s^2")
    if s.policy_loss_mode != "vanilla":
        errors.add(
            f"{NAME}.policy_loss_mode: {s.policy_loss_mode!r} is a form of the clipped ratio; Flow-DPPO masks each "
            "step's ratio by its divergence instead of clipping it; remove the key"
        )
    errors.raise_if_any()


def conventions(settings: Settings) -> str:
    d = {
        True: "D = mean((mu - mu_old)^2) / (2 (std_dev_t sqrt_dt)^2) (verl-omni's add_kl_coefficient: true)",
        False: "D = mean((mu - mu_old)^2) / 2 (verl-omni's add_kl_coefficient: false)",
    }[settings.add_kl_coefficient]
    adv = "unclamped (verl-omni's)" if settings.adv_clip_max is None else f"clamped to +-{settings.adv_clip_max:g}"
    mask = f"masked where D >= {settings.kl_mask_threshold:g} and moving away (verl-omni's flow_dppo)"
    return ", ".join([flowgrpo.conventions(settings), d, mask, f"advantages {adv}"])


def dppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantage: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std_dev_t: torch.Tensor,
    sqrt_dt: torch.Tensor,
    *,
    kl_mask_threshold: float,
    add_kl_coefficient: bool = True,
    adv_clip_max: float | None = None,
    weights: torch.Tensor | None = None,
    ratio_std_ddof: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The divergence-masked loss of one step (module docstring) and its statistics (detached). ``weights``: each
    sample's term times its weight before the mean (verl-omni: ``per_elem_loss * rollout_is_weights``)."""
    import torch

    from runtime.rl.algorithms.objectives import ratio_std, weighted_mean

    b = log_prob.shape[0]
    adv = advantage.detach().to(log_prob.dtype)
    if adv_clip_max is not None:
        adv = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    log_ratio = log_prob - old_log_prob.detach()
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        sq = ((mean - old_mean) ** 2).mean(dim=tuple(range(1, mean.ndim))).to(log_prob.dtype)
        if add_kl_coefficient:  # a row with s = 0 (a deterministic step) is infinitely far once its mean moved
            s2 = ((std_dev_t.reshape(b) * sqrt_dt.reshape(b)) ** 2).to(log_prob.dtype)
            safe = torch.where(s2 > 0, s2, torch.ones_like(s2))
            apart = torch.where(sq > 0, torch.full_like(sq, math.inf), torch.zeros_like(sq))
            div = torch.where(s2 > 0, sq / (2 * safe), apart)
        else:
            div = sq / 2
        far = div >= kl_mask_threshold
        pos = far & (adv > 0) & (ratio > 1)
        neg = far & (adv < 0) & (ratio < 1)
        masked = pos | neg
    per_sample = torch.where(masked, torch.zeros_like(ratio), -adv * ratio)
    loss = weighted_mean(per_sample, weights)
    stats = {
        "policy_loss": loss.detach(),
        "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
        "ratio_std": ratio_std(ratio, ratio_std_ddof),
        "dppo/kl_new_old_mean": div.mean(),
        "dppo/kl_new_old_max": div.max(),
        "dppo/kl_mask_fraction": far.float().mean(),
        "dppo/pos_rm_fraction": pos.float().mean(),
        "dppo/neg_rm_fraction": neg.float().mean(),
        "dppo/masked_fraction": masked.float().mean(),
    }
    return loss, stats


def step_objective(
    settings: Settings,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantage: torch.Tensor,
    kl_terms: Gaussian | None,
    *,
    gaussian: Gaussian,
    weights: torch.Tensor | None = None,
    kl_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one window step of a micro-batch (before the share scaling) and its statistics.

    ``gaussian``: ``(mean, old_mean, std_dev_t, sqrt_dt)`` of the step; ``kl_terms``, ``weights`` and
    ``kl_weights`` as Flow-GRPO's."""
    from runtime.rl.algorithms.objectives import kl_to_reference

    loss, stats = dppo_loss(
        log_prob,
        old_log_prob,
        advantage,
        *gaussian,
        kl_mask_threshold=settings.kl_mask_threshold,
        add_kl_coefficient=settings.add_kl_coefficient,
        adv_clip_max=settings.adv_clip_max,
        weights=weights,
        ratio_std_ddof=settings.ratio_std_ddof,
    )
    if kl_terms is not None:
        kl = kl_to_reference(*kl_terms, settings.kl_form, kl_weights)
        loss = loss + settings.kl_coef * kl
        stats["kl"] = kl.detach()
    return loss, stats


class FlowDPPO(flowgrpo.FlowGRPO):
    """Flow-GRPO's sampling with the divergence-masked objective, which reads the pre-update step means."""

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


ALGORITHM = FlowDPPO()
