"""Rollout correction (verl's decoupled mode, three policies): when the rollout's log-probs come from another engine
than the trained policy (vllm-omni, ``runtime/rl/engines/vllm_omni.py``), the training side recomputes the old
policy's log-probs of the trained steps (no grad, before the first update), anchors the PPO ratio on them and weights
each trained row's loss by ``rollout_correction`` (``correction_config.py``). Without the section the loop is verl's
bypass mode: the rollout's log-probs are the old ones.

Definitions (verl's ``rollout_corr_helper``, which verl-omni calls), with ``lr = log pi_old - log pi_rollout`` of
each trained step ``[B, K]``, clamped to ``[-20, 20]`` before any ``exp``:

* TIS weight: ``token``: ``min(exp(lr), C)`` per step; ``sequence``: ``min(exp(sum_k lr), C)`` per sample;
* rejection statistic: ``k1 = -lr`` (``log pi_rollout / pi_old``), ``k2 = lr^2 / 2``, ``k3 = exp(lr) - 1 - lr`` per
  step (``token_*``), or their sum / mean / max over the sample's trained steps (``seq_sum_*``, ``seq_mean_*``,
  ``seq_max_*``); kept: ``log(lower) <= k1 <= log(upper)``, ``k2, k3 <= upper``;
* applied weight: ``TIS weight x kept`` (1 where IS is off); a rejected row stays in the mean's denominator (verl-omni:
  rejection dilutes the gradient by kept / total rather than renormalising).

Where the weight acts: inside the algorithm's objective (``Algorithm.step_objective``'s ``weights`` and
``kl_weights``), on each sample's term before the objective's batch mean, as verl-omni's losses multiply
``per_elem_loss`` by ``rollout_is_weights``: whatever an objective computes over the micro-batch (GRPO-Guard's
``guard_scale: verl_omni`` scale and ``1 / mean(sqrt_dt)^2``) is computed once, over every row. ``weighted_terms:
all`` (the default) weights the KL and the distillation term too (they are averages over the same rollout states);
``policy`` weights the policy term alone (verl-omni's: its KL and distillation losses are added unweighted, and its
pure distillation, ``loss_mode=distill_kl``, is not weighted at all). Where the trained policy is the rollout policy,
``lr`` is 0 bitwise, every weight is exactly 1, nothing is rejected, and the loss is the uncorrected one, bit for bit
(``x * 1.0`` is ``x``).

Metrics (verl-omni's ``rollout_corr/`` names, over the global batch): ``rollout_is_mean`` / ``_max`` / ``_min``,
``rollout_is_eff_sample_size``, ``rollout_is_ratio_fraction_high`` / ``_low`` (the share truncated at C / below
1 / C), ``rollout_rs_masked_fraction`` (steps), ``rollout_rs_seq_masked_fraction`` (samples), ``kl``
(``mean(log pi_rollout - log pi_old)``), ``k3_kl``, ``log_ppl_diff`` / ``log_ppl_abs_diff`` (per sample,
``mean_k log pi_rollout - mean_k log pi_old``), ``chi2_token`` / ``chi2_seq``, ``logprob_abs_diff_mean`` / ``_max``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from runtime.rl.correction_config import RolloutCorrectionConfig, rs_bounds

if TYPE_CHECKING:
    from runtime.rl.algorithms.base import Algorithm, Gaussian

__all__ = ["SAFETY_BOUND", "correction", "offpolicy_metrics", "weighted_objective"]

SAFETY_BOUND = 20.0  # verl's: exp(+-20) bounds every weight


def _is_weights(lr: torch.Tensor, level: str, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(truncated weights ``[B, K]``, the log-ratio the weight is of: ``[B, K]`` or ``[B, 1]``)."""
    of = lr if level == "token" else lr.sum(dim=1, keepdim=True)
    raw = torch.exp(of.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(lr)
    return raw.clamp(max=threshold), of


def _rs_keep(lr: torch.Tensor, option: str, spec: str | float) -> torch.Tensor:
    """``[B, K]`` bool: the trained steps rejection sampling keeps."""
    lower, upper = rs_bounds(option, spec)
    safe = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    kind = option[-2:]
    stat = -safe if kind == "k1" else 0.5 * safe**2 if kind == "k2" else torch.exp(safe) - 1.0 - safe
    if option.startswith("seq_sum"):
        stat = stat.sum(dim=1, keepdim=True)
    elif option.startswith("seq_mean"):
        stat = stat.mean(dim=1, keepdim=True)
    elif option.startswith("seq_max"):
        stat = stat.max(dim=1, keepdim=True).values
    if kind == "k1":
        keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
    else:
        keep = stat <= upper
    return keep.expand_as(lr)


def offpolicy_metrics(old: torch.Tensor, rollout: torch.Tensor) -> dict[str, float]:
    """The off-policy diagnostics of ``[B, K]`` log-probs (verl's ``compute_offpolicy_metrics`` less the
    perplexities, which a Gaussian density's log-prob makes meaningless)."""
    old, rollout = old.double(), rollout.double()
    lr = old - rollout
    safe = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ppl_diff = rollout.mean(dim=1) - old.mean(dim=1)
    seq = lr.sum(dim=1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "kl": (rollout - old).mean().item(),
        "k3_kl": (torch.exp(lr) - lr - 1).mean().item(),
        "log_ppl_diff": ppl_diff.mean().item(),
        "log_ppl_abs_diff": ppl_diff.abs().mean().item(),
        "chi2_token": (torch.exp(safe).square().mean() - 1.0).item(),
        "chi2_seq": (torch.exp(2.0 * seq).mean() - 1.0).item(),
        "logprob_abs_diff_mean": lr.abs().mean().item(),
        "logprob_abs_diff_max": lr.abs().max().item(),
    }


def correction(
    old: torch.Tensor, rollout: torch.Tensor, rc: RolloutCorrectionConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """The applied weights ``[B, K]`` (float64) of the trained steps' old and rollout log-probs ``[B, K]`` and the
    ``rollout_corr/`` metrics (module docstring)."""
    lr = old.double() - rollout.double()
    weights = torch.ones_like(lr)
    metrics: dict[str, float] = {}
    if rc.rollout_is is not None:
        c = rc.rollout_is_threshold
        is_w, of = _is_weights(lr, rc.rollout_is, c)
        weights = is_w
        if rc.rollout_is == "token":
            metrics["rollout_is_max"], metrics["rollout_is_min"] = is_w.max().item(), is_w.min().item()
        else:  # verl: the untruncated sequence weights' extremes
            metrics["rollout_is_max"] = math.exp(min(of.max().item(), SAFETY_BOUND))
            metrics["rollout_is_min"] = math.exp(of.min().item())
        metrics["rollout_is_mean"] = is_w.mean().item()
        metrics["rollout_is_ratio_fraction_high"] = (of > math.log(c)).double().mean().item()
        metrics["rollout_is_ratio_fraction_low"] = (of < math.log(1.0 / c)).double().mean().item()
        normed = is_w / (is_w.mean() + 1e-8)
        metrics["rollout_is_eff_sample_size"] = 1.0 / normed.square().mean().item()
    if rc.rollout_rs is not None:
        keep = _rs_keep(lr, rc.rollout_rs, rc.rollout_rs_threshold)
        weights = weights * keep.double()
        metrics["rollout_rs_masked_fraction"] = (~keep).double().mean().item()
        metrics["rollout_rs_seq_masked_fraction"] = (~keep).any(dim=1).double().mean().item()
    metrics |= offpolicy_metrics(old, rollout)
    return weights, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def weighted_objective(
    algo: Algorithm,
    settings: Any,
    weights: torch.Tensor,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantage: torch.Tensor,
    kl_terms: Gaussian | None,
    gaussian: Gaussian | None,
    seq_log_ratio: torch.Tensor | None = None,
    *,
    weighted_terms: str = "all",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``algo.step_objective`` of a micro-batch with each sample's terms weighted by ``weights`` ``[B]`` (module
    docstring: the policy term, and the KL or distillation term unless ``weighted_terms`` is ``policy``). All weights
    1: the algorithm's loss itself (bitwise the uncorrected run). ``policy_loss`` (and ``kl``) are the weighted
    terms the update minimises; the ratio statistics are the unweighted batch's (verl-omni's are unweighted too).
    ``seq_log_ratio``: passed on to an algorithm that takes it (``needs_sequence_ratio``)."""
    seq = {} if seq_log_ratio is None else {"seq_log_ratio": seq_log_ratio}
    w = weights.detach().to(log_prob.device)
    kl_w = w if weighted_terms == "all" else None
    return algo.step_objective(
        settings, log_prob, old_log_prob, advantage, kl_terms, gaussian, **seq, weights=w, kl_weights=kl_w
    )
