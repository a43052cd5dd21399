"""Flow-GRPO objective: group advantages, the clipped PPO policy loss, and the KL to a reference policy.

Advantages (one reward per sample, samples of the same prompt form a group, ``group_ids`` says which)::

    "group":  A_i = (r_i - mean_g) / (std_g + eps)      std over the group
    "global": A_i = (r_i - mean_g) / (std_all + eps)    std over the whole batch (robust for tiny groups)
    "none":   A_i =  r_i - mean_g                       (Dr.GRPO-style, no scaling)

The std's divisor is ``n - ddof``: ``ddof=1`` (the sample std, ``torch.std``) is verl-omni's convention and the
default; ``ddof=0`` (the population std, ``np.std``) is flow_grpo's. On a group of ``G`` the two advantages differ
by ``sqrt(G / (G - 1))`` (1.15x at G = 4). A group (or batch) of one sample has advantage 0 under both.

Policy loss for one denoising step (``logp``, ``logp_old`` of shape ``[B]``)::

    A     = clamp(A, -adv_clip_max, adv_clip_max)
    ratio = exp(logp - logp_old)
    loss  = mean(max(-A * ratio, -A * clamp(ratio, 1 - clip_range, 1 + clip_range)))
    clip_fraction = mean(|ratio - 1| > clip_range)
    approx_kl     = 0.5 * mean((logp - logp_old) ** 2)

Sequence-level ratio (``policy_loss_mode: gspo``: GSPO, Zheng et al. 2025, arXiv:2507.18071; verl's
``policy_loss.loss_mode: gspo``). One ratio per sample, the geometric mean of its per-step ratios over the ``K``
steps it trains this iteration (``seq_log_ratio = mean_k(logp_k - logp_old_k)``, computed by the loop before the
epoch's backward passes), clipped per sample. Each step's term carries it with the step's own gradient (verl's
stop-gradient form)::

    log s  = min(sg(seq_log_ratio) + logp_k - sg(logp_k), 10)      value s = exp(seq_log_ratio) at every step k
    loss_k = mean(max(-A * s, -A * clamp(s, 1 - clip_range, 1 + clip_range)))

so ``(1/K) sum_k loss_k`` is GSPO's ``mean_b max(-A s_b, -A clip(s_b))`` with its gradient ``-A s_b (1/K) sum_k
grad logp_k`` where unclipped (the cap at 10 is verl's guard against overflow).

``adv_clip_max: null`` leaves the advantages unclamped (verl's ``gspo``, which clamps nothing).

Per-sample weights (``weights``, ``[B]``, detached: rollout correction's, ``runtime/rl/rollout_correction.py``)
multiply each sample's term before the batch mean, ``mean_b(w_b l_b)``; whatever the objective computes over the
micro-batch (a shared scale, a divisor) is computed once, from every row. Weights exactly 1 give the unweighted loss
bitwise (``x * 1.0`` is ``x``).

Ratio statistics (``ratio_stats``, verl's PPO names in brackets): ``clip_fraction_high = mean(ratio > 1 + clip_range)``
(``pg_clipfrac``'s upper side), ``clip_fraction_low = mean(ratio < 1 - clip_range)`` (``pg_clipfrac_lower``),
``ratio_std`` (the spread the clip acts on; ``ddof`` 0: the population std, ours and verl-omni's ``flow_dppo``; 1:
``torch.std``, verl-omni's ``flow_grpo`` and ``grpo_guard``: ``sqrt(n / (n - 1))`` larger, 1.41x at a micro-batch of
2; a micro-batch of one has 0 under both). GSPO's verl form (``gspo_clip_fraction: verl``, ``binding_clip_fraction``):
``clip_fraction = clip_fraction_high = mean(max term is the clipped one)``, the share where the clip binds (it binds
on one side only: ``A > 0`` above ``1 + clip_range``, ``A < 0`` below ``1 - clip_range``), ``clip_fraction_low = 0``
(verl's ``pg_clipfrac_lower``, fixed at 0 for ``gspo``). A group whose rewards are all equal has no signal:
``zero_std_ratio`` is the share of such groups in the batch (DAPO's dynamic sampling filters them).

KL to the reference. Both policies are Gaussians of the same (isotropic) std ``s = std_dev_t * sqrt_dt`` that the
schedule fixes, so the exact per-element KL is ``(mean - ref_mean)^2 / (2 s^2)``. Two forms (``kl_form``)::

    "scaled": kl = mean_b( mean_{non-batch}((mean - ref_mean) ** 2) / (2 * std_dev_t_b ** 2) )
    "exact":  kl = mean_b( mean_{non-batch}((mean - ref_mean) ** 2) / (2 * s_b ** 2) )

``"scaled"`` is verl-omni's and flow_grpo's (their scripts divide by ``std_dev_t ** 2``, leaving out ``-dt``) and
the default: for the "sde" step it is the exact KL times ``-dt = sigma_i - sigma_{i+1}``, so at 10 steps it is
several to a hundred times smaller than the exact KL and a ``kl_coef`` means something else in each form. For the
"cps" step ``sqrt_dt`` is 1 and the forms agree. ``"exact"`` is the per-element average of
``KL(N(mean, s^2) || N(ref_mean, s^2))``. Rows with ``s = 0`` (deterministic steps) contribute 0 in both.
"""

from __future__ import annotations

from typing import Literal

import torch

AdvantageMode = Literal["group", "global", "none"]
KlForm = Literal["scaled", "exact"]
KL_FORMS = ("scaled", "exact")  # the first is verl-omni's (the default)

__all__ = [
    "AdvantageMode",
    "KL_FORMS",
    "binding_clip_fraction",
    "KlForm",
    "group_advantages",
    "kl_to_reference",
    "policy_loss",
    "ratio_stats",
    "ratio_std",
    "sequence_policy_loss",
    "weighted_mean",
    "zero_std_ratio",
]


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mode: AdvantageMode = "group",
    eps: float = 1e-4,
    ddof: int = 1,
) -> torch.Tensor:
    """Per-sample advantages from ``rewards`` ``[B]`` normalised within the prompt groups ``group_ids`` ``[B]``.

    Computed in float64 and returned as float32. Group ids may be any integers (not necessarily contiguous).
    ``ddof``: 1 (verl-omni) or 0 (flow_grpo), see the module docstring.
    """
    if mode not in ("group", "global", "none"):
        raise ValueError(f"unknown advantage mode {mode!r}; expected 'group', 'global' or 'none'")
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 (flow_grpo) or 1 (verl-omni), got {ddof!r}")
    r = rewards.detach().to(torch.float64).reshape(-1)
    g = torch.as_tensor(group_ids, device=r.device).reshape(-1)
    if g.shape != r.shape:
        raise ValueError(f"rewards {tuple(r.shape)} and group_ids {tuple(g.shape)} must have the same length")
    _, inverse, counts = torch.unique(g, return_inverse=True, return_counts=True)
    n = counts.to(torch.float64)
    group_mean = torch.zeros_like(n).index_add_(0, inverse, r) / n
    centered = r - group_mean[inverse]
    if mode == "none":
        adv = centered
    elif mode == "global":
        all_var = ((r - r.mean()) ** 2).sum() / max(r.numel() - ddof, 1)
        adv = centered / (all_var.sqrt() + eps)
    else:  # a group of one is centred to 0; any finite divisor keeps it 0
        group_var = torch.zeros_like(n).index_add_(0, inverse, centered**2) / torch.clamp(n - ddof, min=1)
        adv = centered / (group_var.sqrt()[inverse] + eps)
    return adv.to(torch.float32)


def weighted_mean(per_sample: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``mean_b(w_b l_b)`` of per-sample terms ``[B]`` (``weights`` None: ``mean_b(l_b)``): the correction weight
    multiplies each sample's term, the batch's reduction stays the objective's."""
    if weights is None:
        return per_sample.mean()
    return (per_sample * weights.detach().to(device=per_sample.device, dtype=per_sample.dtype)).mean()


def _clamped(advantages: torch.Tensor, dtype: torch.dtype, adv_clip_max: float | None) -> torch.Tensor:
    adv = advantages.to(dtype)
    return adv if adv_clip_max is None else torch.clamp(adv, -adv_clip_max, adv_clip_max)


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float = 1e-4,
    adv_clip_max: float | None = 5.0,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clipped PPO loss of one step; returns ``(loss, clip_fraction, approx_kl)`` (the last two detached)."""
    adv = _clamped(advantages, log_prob.dtype, adv_clip_max)
    diff = log_prob - old_log_prob.detach()
    ratio = torch.exp(diff)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = weighted_mean(torch.maximum(unclipped, clipped), weights)
    clip_fraction = ((ratio.detach() - 1.0).abs() > clip_range).float().mean()
    approx_kl = 0.5 * (diff.detach() ** 2).mean()
    return loss, clip_fraction, approx_kl


def sequence_policy_loss(
    log_prob: torch.Tensor,
    seq_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float = 1e-4,
    adv_clip_max: float | None = 5.0,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's share of the sequence-level (GSPO) clipped loss (module docstring); returns ``(loss,
    clip_fraction, approx_kl, ratio)``, the last three detached (``approx_kl`` of the sequence log-ratio)."""
    adv = _clamped(advantages, log_prob.dtype, adv_clip_max)
    seq = seq_log_ratio.detach().to(log_prob.dtype)
    ratio = torch.exp(torch.clamp(seq + log_prob - log_prob.detach(), max=10.0))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = weighted_mean(torch.maximum(unclipped, clipped), weights)
    clip_fraction = ((ratio.detach() - 1.0).abs() > clip_range).float().mean()
    return loss, clip_fraction, 0.5 * (seq**2).mean(), ratio.detach()


def binding_clip_fraction(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_range: float, adv_clip_max: float | None
) -> torch.Tensor:
    """The share of samples whose clipped term is the larger one (verl's ``gspo`` ``pg_clipfrac``: the clip binds),
    detached."""
    ratio = ratio.detach()
    adv = _clamped(advantages.detach(), ratio.dtype, adv_clip_max)
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return (clipped > -adv * ratio).float().mean()


def ratio_stats(ratio: torch.Tensor, clip_range: float, ddof: int = 0) -> dict[str, torch.Tensor]:
    """``clip_fraction_high``, ``clip_fraction_low`` and ``ratio_std`` (divisor ``n - ddof``) of one step's importance
    ratios (detached)."""
    ratio = ratio.detach()
    return {
        "clip_fraction_high": (ratio > 1.0 + clip_range).float().mean(),
        "clip_fraction_low": (ratio < 1.0 - clip_range).float().mean(),
        "ratio_std": ratio_std(ratio, ddof),
    }


def ratio_std(ratio: torch.Tensor, ddof: int = 0) -> torch.Tensor:
    """The std of the ratios (detached) with divisor ``n - ddof``: 0 for a single ratio under either divisor."""
    ratio = ratio.detach()
    if ratio.numel() <= 1:
        return torch.zeros((), device=ratio.device, dtype=ratio.dtype)
    return ratio.std(correction=ddof)


def zero_std_ratio(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """The share of the batch's groups whose rewards are all equal (exactly: the advantages are then all 0)."""
    groups = torch.unique(group_ids)
    flat = [bool((rewards[group_ids == g] == rewards[group_ids == g][0]).all()) for g in groups.tolist()]
    return sum(flat) / len(flat)


def kl_to_reference(
    prev_sample_mean: torch.Tensor,
    ref_prev_sample_mean: torch.Tensor,
    std_dev_t: torch.Tensor,
    sqrt_dt: torch.Tensor,
    form: KlForm = "scaled",
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batch-mean KL between the policy's and the reference's step Gaussians in ``form`` (module docstring), each
    sample's KL times ``weights`` when given."""
    if form not in KL_FORMS:
        raise ValueError(f"unknown KL form {form!r}; expected one of {', '.join(KL_FORMS)}")
    std = (std_dev_t if form == "scaled" else std_dev_t * sqrt_dt).reshape(-1)
    sq = ((prev_sample_mean - ref_prev_sample_mean.detach()) ** 2).mean(dim=tuple(range(1, prev_sample_mean.ndim)))
    ok = std > 0
    safe = torch.where(ok, std, torch.ones_like(std))
    kl = torch.where(ok, sq / (2 * safe**2), torch.zeros_like(sq))
    return weighted_mean(kl, weights)
