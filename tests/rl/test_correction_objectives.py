"""Rollout correction inside each algorithm's objective (``runtime/rl/rollout_correction.py``, ``weighted_objective``):
for every algorithm that trains on the rollout's steps and every correction mode, the weighted loss and its gradient
against a float64 reference written here from the algorithm's documented formula, with the weights written here from
verl's ``rollout_corr_helper`` formulas; the weight multiplies each sample's term before the objective's batch mean
(verl-omni's losses: ``per_elem_loss * rollout_is_weights``, then the mean), so a batch-level quantity such as
GRPO-Guard's ``guard_scale: verl_omni`` scale is the whole micro-batch's. The micro-batch mixes denoising steps
(each row its own ``std_dev_t`` and ``sqrt_dt``), where a row-at-a-time evaluation gave GRPO-Guard one scale per row.
Weights exactly 1 give the uncorrected objective bitwise, loss and gradient."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.rl.test_algorithms import _guard_inputs, _log_prob

B, K, STEP = 6, 3, 0  # samples, trained steps per sample, the step whose objective is compared
DIMS = (1, 2, 3)

# (id, algorithm, settings): every algorithm that trains on the rollout's steps, each objective form
CASES = [
    ("flowgrpo", "flowgrpo", {"clip_range": 0.05, "adv_clip_max": 2.0, "kl_coef": 0.1}),
    (
        "flowgrpo-gspo",
        "flowgrpo",
        {"clip_range": 0.05, "adv_clip_max": 2.0, "kl_coef": 0.1, "policy_loss_mode": "gspo"},
    ),
    ("mixgrpo", "mixgrpo", {"clip_range": 0.05, "adv_clip_max": 2.0, "kl_coef": 0.1}),
    ("dancegrpo", "dancegrpo", {"clip_range": 0.05, "adv_clip_max": 2.0, "kl_coef": 0.1}),
    ("grpo_guard-per_sample", "grpo_guard", {"clip_range": 0.02, "adv_clip_max": 2.0, "kl_coef": 0.1}),
    (
        "grpo_guard-verl_omni",
        "grpo_guard",
        {"clip_range": 0.02, "adv_clip_max": 2.0, "kl_coef": 0.1, "guard_scale": "verl_omni"},
    ),
    ("flowdppo", "flowdppo", {"kl_mask_threshold": 1e-3, "kl_coef": 0.1}),
    ("diffusionopd-distill_kl", "diffusionopd", {"distill_loss_coef": 0.7}),
    ("diffusionopd-distill_fm_mse", "diffusionopd", {"distill_loss_coef": 0.7, "distill_loss_mode": "distill_fm_mse"}),
    (
        "diffusionopd-flow_grpo",
        "diffusionopd",
        {"distill_loss_coef": 0.7, "loss_mode": "flow_grpo", "clip_range": 0.05, "adv_clip_max": 2.0},
    ),
]

# rollout_correction sections: truncated IS per step and per sample, rejection per step and per sample, both together,
# and verl-omni's weighting of the policy term alone
MODES = [
    ("is_token", {"rollout_is": "token", "rollout_is_threshold": 1.16}),
    ("is_sequence", {"rollout_is": "sequence", "rollout_is_threshold": 1.1}),
    ("rs_token_k1", {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.8_1.25"}),
    ("rs_seq_mean_k3", {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.02}),
    (
        "is_token+rs_seq_max_k2",
        {
            "rollout_is": "token",
            "rollout_is_threshold": 1.16,
            "rollout_rs": "seq_max_k2",
            "rollout_rs_threshold": 0.04,
        },
    ),
    (
        "is_token+rs_token_k2-policy",
        {
            "rollout_is": "token",
            "rollout_is_threshold": 1.16,
            "rollout_rs": "token_k2",
            "rollout_rs_threshold": 0.04,
            "weighted_terms": "policy",
        },
    ),
    ("is_sequence-policy", {"rollout_is": "sequence", "rollout_is_threshold": 1.1, "weighted_terms": "policy"}),
]


# ------------------------------------------------------------------------------------- verl's weights, written out
def _log_probs() -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, K]`` log-probs of the old policy and of another engine's rollout."""
    g = torch.Generator().manual_seed(21)
    old = -1.0 + 0.3 * torch.randn(B, K, generator=g, dtype=torch.float64)
    return old, old + 0.25 * torch.randn(B, K, generator=g, dtype=torch.float64)


def _verl_weights(section: dict) -> torch.Tensor:
    """verl's rollout_corr_helper: ``lr = log pi_old - log pi_rollout``; IS ``min(exp(lr), C)`` per step or
    ``min(exp(sum_k lr), C)`` per sample; RS statistic k1 ``-lr``, k2 ``lr^2 / 2``, k3 ``exp(lr) - 1 - lr`` per step or
    its sum / mean / max over the sample, k1 kept in ``[log lower, log upper]``, k2 / k3 kept ``<= upper``; the
    weight ``IS x kept``. Returns the weights ``[B]`` of step ``STEP``."""
    old, rollout = _log_probs()
    lr = old - rollout
    w = torch.ones(B, K, dtype=torch.float64)
    if section.get("rollout_is") == "token":
        w = torch.exp(lr).clamp(max=section["rollout_is_threshold"])
    elif section.get("rollout_is") == "sequence":
        w = torch.exp(lr.sum(dim=1, keepdim=True)).clamp(max=section["rollout_is_threshold"]).expand(B, K)
    rs = section.get("rollout_rs")
    if rs is not None:
        level, kind = rs.rsplit("_", 1)
        stat = {"k1": -lr, "k2": lr**2 / 2, "k3": torch.exp(lr) - 1 - lr}[kind]
        reduce = {"seq_sum": stat.sum(1, keepdim=True), "seq_mean": stat.mean(1, keepdim=True)}
        reduce["seq_max"] = stat.max(1, keepdim=True).values
        stat = reduce.get(level, stat).expand(B, K)
        spec = section["rollout_rs_threshold"]
        if kind == "k1":
            lower, upper = (float(v) for v in str(spec).split("_"))
            kept = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            kept = stat <= float(spec)
        w = w * kept
    return w[:, STEP]


# ------------------------------------------------------------------------------ the objectives, written out
def _inputs(dtype: torch.dtype) -> dict:
    """GRPO-Guard's test step (a micro-batch of six samples at six different denoising steps, mean shifts from 0 to
    2), a reference (or teacher) mean beside it, and each sample's GSPO sequence log-ratio."""
    d = _guard_inputs(torch.float64)
    g = torch.Generator().manual_seed(4)
    d["ref"] = d["old_mean"] + 0.05 * torch.randn(d["old_mean"].shape, generator=g, dtype=torch.float64)
    d["seq"] = torch.tensor([0.0, 0.01, -0.03, 0.08, -0.2, 0.02], dtype=torch.float64)
    return {k: v.to(dtype) for k, v in d.items()}


def _clip(r: torch.Tensor, a: torch.Tensor, clip: float) -> torch.Tensor:
    return torch.maximum(-a * r, -a * r.clamp(1 - clip, 1 + clip))


def _gaussian_kl(d: dict, mean: torch.Tensor, exact: bool) -> torch.Tensor:
    """Per sample ``mean_d((mu - mu_ref)^2) / (2 sigma^2)``, sigma ``std_dev_t`` (scaled) or ``std_dev_t sqrt_dt``."""
    sigma = (d["std_dev_t"] * d["sqrt_dt"] if exact else d["std_dev_t"]).reshape(-1)
    return ((mean - d["ref"]) ** 2).mean(dim=DIMS) / (2 * sigma**2)


def _reference(case: str, s: dict, d: dict, shift: torch.Tensor, w: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
    """The documented loss of ``case`` with the policy term's per-sample weights ``w`` and the KL or distillation
    term's ``kw`` (float64; differentiable in the mean shift)."""
    mean = d["old_mean"] + shift
    std = d["std_dev_t"] * d["sqrt_dt"]
    log_ratio = _log_prob(d["x"], mean, std) - _log_prob(d["x"], d["old_mean"], std)
    adv = d["advantage"] if s.get("adv_clip_max") is None else d["advantage"].clamp(-2.0, 2.0)
    sq = (shift**2).mean(dim=DIMS)
    kl = s.get("kl_coef", 0.0) * (kw * _gaussian_kl(d, mean, case == "dancegrpo")).mean()  # dancegrpo: exact
    if case in ("flowgrpo", "mixgrpo", "dancegrpo"):  # Flow-GRPO: mean_b(w max(-A r, -A clip(r))) + beta KL
        return (w * _clip(log_ratio.exp(), adv, s["clip_range"])).mean() + kl
    if case == "flowgrpo-gspo":  # GSPO: s_b = exp(seq_b) in value, its gradient the step's log-prob's
        ratio = torch.exp(d["seq"] + log_ratio - log_ratio.detach())
        return (w * _clip(ratio, adv, s["clip_range"])).mean() + kl
    if case == "grpo_guard-per_sample":  # the paper: each sample's s and -dt
        s_b, dt = std.reshape(-1), d["sqrt_dt"].reshape(-1) ** 2
        ratio = torch.exp((log_ratio + sq / (2 * s_b**2)) * s_b)
        return (w * _clip(ratio, adv, s["clip_range"]) / dt).mean() + kl
    if case == "grpo_guard-verl_omni":  # verl-omni's GRPOGuardLoss: one scale and one 1/dt for the micro-batch
        scale = d["std_dev_t"].mean() * d["sqrt_dt"].mean()
        ratio = torch.exp((log_ratio + sq / (2 * scale**2)) * scale)
        return (w * _clip(ratio, adv, s["clip_range"])).mean() / d["sqrt_dt"].mean() ** 2 + kl
    if case == "flowdppo":  # masked where D >= threshold and the step moves away; loss mean_b(w (-A r)) elsewhere
        r = log_ratio.exp()
        div = sq.detach() / (2 * std.reshape(-1) ** 2)
        away = (div >= s["kl_mask_threshold"]) & (((adv > 0) & (r > 1)) | ((adv < 0) & (r < 1)))
        return (w * torch.where(away, torch.zeros_like(r), -adv * r)).mean() + kl
    coef = s["distill_loss_coef"]
    if case == "diffusionopd-distill_fm_mse":  # the mean's stand-in for the student's velocity
        return coef * (kw * ((mean - d["ref"]) ** 2).mean(dim=DIMS)).mean()
    distill = coef * (kw * _gaussian_kl(d, mean, False)).mean()
    if case == "diffusionopd-flow_grpo":
        return (w * _clip(log_ratio.exp(), adv, s["clip_range"])).mean() + distill
    return distill


def _ours(case: str, name: str, s: dict, d: dict, weights: torch.Tensor | None, terms: str = "all") -> tuple:
    """(loss, gradient w.r.t. the mean shift) of the algorithm's objective: through ``weighted_objective`` with
    ``weights``, or its plain ``step_objective`` (None)."""
    from runtime.rl.config import algorithm
    from runtime.rl.rollout_correction import weighted_objective

    algo = algorithm(name)
    settings = algo.Settings(**s)
    shift = d["delta"].clone().requires_grad_(True)
    mean = d["old_mean"] + shift
    std = d["std_dev_t"] * d["sqrt_dt"]
    log_prob, old = _log_prob(d["x"], mean, std), _log_prob(d["x"], d["old_mean"], std)
    gaussian = (mean, d["old_mean"], d["std_dev_t"], d["sqrt_dt"]) if algo.needs_old_mean else None
    kl_terms = (mean, d["ref"], d["std_dev_t"], d["sqrt_dt"]) if algo.needs_reference(settings) else None
    seq = {"seq_log_ratio": d["seq"]} if algo.needs_sequence_ratio(settings) else {}
    if weights is None:
        loss, stats = algo.step_objective(settings, log_prob, old, d["advantage"], kl_terms, gaussian, **seq)
    else:
        loss, stats = weighted_objective(
            algo, settings, weights, log_prob, old, d["advantage"], kl_terms, gaussian, **seq, weighted_terms=terms
        )
    (grad,) = torch.autograd.grad(loss, shift)
    return loss.detach(), grad, stats


def test_the_modes_weights_are_verls_and_not_unit() -> None:
    """The weights every mode below feeds the objectives: ``correction``'s equal verl's formulas, none all 1, and
    each rejection mode rejects some samples and keeps others."""
    from runtime.rl.correction_config import RolloutCorrectionConfig
    from runtime.rl.rollout_correction import correction

    for name, section in MODES:
        weights, _ = correction(*_log_probs(), RolloutCorrectionConfig(**section))
        ref = _verl_weights(section)
        torch.testing.assert_close(weights[:, STEP], ref, rtol=1e-12, atol=1e-15)  # float64, sum before exp
        assert not bool((ref == 1).all()), name
        if "rollout_is" in section:  # truncation at C seen
            assert (ref == section["rollout_is_threshold"]).any(), (name, ref)
        if "rollout_rs" in section:
            assert 0 < int((ref == 0).sum()) < B, (name, ref)


@pytest.mark.parametrize(("case", "name", "settings"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize(("mode", "section"), MODES, ids=[m[0] for m in MODES])
def test_weighted_objective_is_the_documented_one(case: str, name: str, settings: dict, mode: str, section: dict):
    from runtime.rl.correction_config import RolloutCorrectionConfig
    from runtime.rl.rollout_correction import correction

    d = _inputs(torch.float64)
    rc = RolloutCorrectionConfig(**section)
    weights = correction(*_log_probs(), rc)[0][:, STEP]
    loss, grad, _ = _ours(case, name, settings, d, weights, rc.weighted_terms)
    w = _verl_weights(section)
    kw = w if rc.weighted_terms == "all" else torch.ones(B, dtype=torch.float64)  # verl-omni: KL, distill unweighted
    shift = d["delta"].clone().requires_grad_(True)
    ref_loss = _reference(case, settings, d, shift, w, kw)
    (ref_grad,) = torch.autograd.grad(ref_loss, shift)
    # float64 on both sides, the same terms reduced in another order
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-8, atol=1e-12)
    assert ref_grad.abs().sum() > 0


@pytest.mark.parametrize(("case", "name", "settings"), CASES, ids=[c[0] for c in CASES])
def test_unit_weights_are_the_uncorrected_objective_bitwise(case: str, name: str, settings: dict) -> None:
    for dtype in (torch.float32, torch.float64):
        d = _inputs(dtype)
        want, want_grad, want_stats = _ours(case, name, settings, d, None)
        for terms in ("all", "policy"):
            got, got_grad, got_stats = _ours(case, name, settings, d, torch.ones(B, dtype=torch.float64), terms)
            assert torch.equal(got, want) and torch.equal(got_grad, want_grad), (case, dtype, terms)
            assert all(torch.equal(got_stats[k], v) for k, v in want_stats.items()), (case, dtype, terms)


def test_a_mixed_step_micro_batch_takes_one_guard_scale() -> None:
    """GRPO-Guard ``verl_omni`` under correction: one scale for the six samples' six steps. Each row on its own
    (its own scale, its own ``1 / sqrt_dt^2``) is another loss and another gradient direction."""
    case, name, settings = CASES[5]
    d = _inputs(torch.float64)
    w = _verl_weights(MODES[0][1])
    loss, grad, _ = _ours(case, name, settings, d, w)
    rows: Any = []
    for r in range(B):
        one = {k: (v[r : r + 1] if v.ndim and v.shape[0] == B else v) for k, v in d.items()}
        rows.append(_ours(case, name, settings, one, w[r : r + 1])[:2])
    per_row = sum(loss for loss, _ in rows) / B
    per_row_grad = torch.cat([g for _, g in rows]) / B
    assert abs(per_row - loss) > 0.05 * abs(loss)
    cosine = torch.nn.functional.cosine_similarity(per_row_grad.flatten(), grad.flatten(), dim=0)
    assert cosine < 0.999


def test_the_loop_passes_weighted_terms(tiny_pipelines, tmp_path) -> None:
    """One off-policy iteration (two inner epochs) of a tiny Flux run with a KL term under each ``weighted_terms``:
    the policy term is weighted alike (the same loss, bitwise: the first update does not see the KL, whose gradient
    is 0 at the reference), the KL term only under ``all`` (another ``kl``)."""
    from runtime.rl.loop import iteration
    from tests.rl.common import rl_config, start
    from tests.rl.test_rollout_correction import CORRECTION, _OffPolicyRollout

    out = {}
    for terms in ("all", "policy"):
        raw = rl_config(
            "flux",
            tiny_pipelines("flux"),
            tmp_path,
            rollout_correction={**CORRECTION, "weighted_terms": terms},
            flowgrpo={"kl_coef": 0.5, "inner_epochs": 2},  # the KL is 0 until the first update
        )
        run, _ = start(raw)
        with _OffPolicyRollout():
            out[terms] = iteration(run, 1)[0]
    assert 0 < out["all"]["rollout_corr/rollout_rs_masked_fraction"] < 1
    assert out["all"]["policy_loss"] == out["policy"]["policy_loss"]
    assert out["all"]["kl"] != out["policy"]["kl"]
