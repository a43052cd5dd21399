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

The weight multiplies the row's whole objective (its KL term too, where ``kl_coef > 0``: verl-omni weights only the
policy term, its KL loss being computed elsewhere). Where the trained policy is the rollout policy, ``lr`` is 0
bitwise, every weight is exactly 1, nothing is rejected, and the loss is the uncorrected one, bit for bit.

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


def _row(t: torch.Tensor, r: int, n: int) -> torch.Tensor:
    return t[r : r + 1] if t.ndim and t.shape[0] == n else t


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``algo.step_objective`` of a micro-batch with row ``r``'s objective weighted by ``weights[r]``: ``sum_r w_r
    l_r / n``. All weights 1: the algorithm's loss itself (bitwise the uncorrected run). ``policy_loss`` is weighted
    alike; the ratio statistics are the unweighted batch's (verl-omni's are unweighted too). ``seq_log_ratio``:
    passed on (per row) to an algorithm that takes it (``needs_sequence_ratio``)."""
    seq = {} if seq_log_ratio is None else {"seq_log_ratio": seq_log_ratio}
    loss, stats = algo.step_objective(settings, log_prob, old_log_prob, advantage, kl_terms, gaussian, **seq)
    if bool((weights == 1).all()):
        return loss, stats
    n = log_prob.shape[0]
    parts, policy = [], []
    for r in range(n):
        kl_r = None if kl_terms is None else tuple(_row(t, r, n) for t in kl_terms)
        g_r = None if gaussian is None else tuple(_row(t, r, n) for t in gaussian)
        seq_r = {} if seq_log_ratio is None else {"seq_log_ratio": seq_log_ratio[r : r + 1]}
        l_r, stats_r = algo.step_objective(
            settings, log_prob[r : r + 1], old_log_prob[r : r + 1], advantage[r : r + 1], kl_r, g_r, **seq_r
        )
        w = weights[r].to(l_r.dtype)
        parts.append(l_r * w)
        if "policy_loss" in stats_r:
            policy.append(stats_r["policy_loss"] * w)
    if len(policy) == n:  # the logged policy loss is the weighted one the update minimises
        stats = {**stats, "policy_loss": torch.stack(policy).sum() / n}
    return torch.stack(parts).sum() / n, stats
