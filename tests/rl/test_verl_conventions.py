"""verl's and verl-omni's conventions offered beside ours (docs/flowgrpo.md, "Conventions"), each against a float64
re-derivation written here from the peer's description, not imported from ours: GSPO without an advantage clamp and
its clip fraction where the clip binds (verl's ``gspo``), ``ratio_std`` with ``torch.std``'s divisor (verl-omni's
``flow_grpo`` / ``grpo_guard``), pure distillation without ``distill_loss_coef`` (verl-omni's
``loss_mode=distill_kl``), and the defaults kept; the keys refused in one line where they do not apply. (The
distillation and KL terms left unweighted by rollout correction, ``weighted_terms: policy``, are in
``test_correction_objectives.py``.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.rl.common import for_algorithm, rl_config

B = 8


def _gspo_inputs() -> dict:
    """One trained step of ``B`` samples: log-probs, each sample's sequence log-ratio, advantages up to 9 (verl's
    GSPO clamps none)."""
    g = torch.Generator().manual_seed(12)
    log_prob = -1.0 + 0.1 * torch.randn(B, generator=g, dtype=torch.float64)
    seq = torch.tensor([0.0, 0.02, -0.03, 0.08, -0.12, 0.01, -0.06, 0.15], dtype=torch.float64)
    adv = torch.tensor([9.0, -7.5, 0.4, -2.5, 6.0, -0.9, 1.2, -3.0], dtype=torch.float64)
    return {"log_prob": log_prob, "old": log_prob - 0.01, "seq": seq, "adv": adv}


def _verl_gspo(d: dict, clip: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """verl's compute_policy_loss_gspo of one token per sequence: ``s = exp(sg(seq) + logp - sg(logp))``, log capped
    at 10, ``pg_losses = max(-A s, -A clip(s))`` with A unclamped, ``pg_clipfrac = mean(-A clip(s) > -A s)``,
    ``pg_clipfrac_lower = 0``. (loss, its gradient w.r.t. the log-probs, pg_clipfrac, pg_clipfrac_lower)."""
    lp = d["log_prob"].clone().requires_grad_(True)
    s = torch.exp(torch.clamp(d["seq"] + lp - lp.detach(), max=10.0))
    pg1, pg2 = -d["adv"] * s, -d["adv"] * torch.clamp(s, 1 - clip, 1 + clip)
    loss = torch.maximum(pg1, pg2).mean()
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, (pg2 > pg1).double().mean(), 0.0


def _ours_gspo(d: dict, clip: float, **settings: object) -> tuple[torch.Tensor, torch.Tensor, dict]:
    from runtime.rl.algorithms.flowgrpo import Settings, step_objective

    s = Settings(clip_range=clip, policy_loss_mode="gspo", **settings)
    lp = d["log_prob"].clone().requires_grad_(True)
    loss, stats = step_objective(s, lp, d["old"], d["adv"], None, seq_log_ratio=d["seq"])
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, stats


def test_gspo_without_the_clamp_is_verls_gspo() -> None:
    d, clip = _gspo_inputs(), 0.05
    ref_loss, ref_grad, _, _ = _verl_gspo(d, clip)
    loss, grad, _ = _ours_gspo(d, clip, adv_clip_max=None)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-15)  # float64, the same terms
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)
    clamped, _, _ = _ours_gspo(d, clip)  # the default clamps at +-5: advantages 9, -7.5 and 6 differ
    assert abs(clamped - ref_loss) > 0.1


def test_gspo_clip_fraction_verl_is_where_the_clip_binds() -> None:
    d, clip = _gspo_inputs(), 0.05
    _, _, frac, lower = _verl_gspo(d, clip)
    _, _, stats = _ours_gspo(d, clip, adv_clip_max=None, gspo_clip_fraction="verl")
    assert stats["clip_fraction"].item() == pytest.approx(frac.item(), abs=0)
    assert stats["clip_fraction_high"].item() == pytest.approx(frac.item(), abs=0)
    assert stats["clip_fraction_low"].item() == lower
    _, _, band = _ours_gspo(d, clip, adv_clip_max=None)  # ours: the ratio outside the band, each side counted
    s = np.exp(d["seq"].numpy())
    assert band["clip_fraction"].item() == pytest.approx(np.mean(np.abs(s - 1) > clip), abs=0)
    assert band["clip_fraction_low"].item() == pytest.approx(np.mean(s < 1 - clip), abs=0)
    assert band["clip_fraction"].item() - stats["clip_fraction"].item() >= 0.25  # the inputs tell them apart


def _ratio_stats_of(name: str, ddof: int, log_ratio: torch.Tensor) -> float:
    """``ratio_std`` of one step of ``name``'s objective with ``ratio_std_ddof: ddof`` (a mean shift of 0: the
    Gaussian-reading algorithms' ratio is the plain one)."""
    from runtime.rl.config import algorithm

    algo = algorithm(name)
    b = log_ratio.shape[0]
    extra = {"guard_scale": "per_sample", "ratio_norm": False} if name == "grpo_guard" else {}
    settings = algo.Settings(ratio_std_ddof=ddof, **extra)
    old = torch.zeros(b, dtype=torch.float64)
    mean = torch.zeros((b, 2), dtype=torch.float64)
    ones = torch.ones(b, dtype=torch.float64)
    gaussian = (mean, mean, ones, ones)
    kl_terms = gaussian if algo.needs_reference(settings) else None
    _, stats = algo.step_objective(
        settings, old + log_ratio, old, ones, kl_terms, gaussian if algo.needs_old_mean else None
    )
    return stats["ratio_std"].item()


@pytest.mark.parametrize("name", ["flowgrpo", "grpo_guard", "flowdppo", "diffusionopd", "dancegrpo", "mixgrpo"])
def test_ratio_std_ddof_is_numpys_divisor(name: str) -> None:
    log_ratio = torch.tensor([0.01, -0.02, 0.005, 0.03, -0.01, 0.0], dtype=torch.float64)
    r = np.exp(log_ratio.numpy())
    assert _ratio_stats_of(name, 0, log_ratio) == pytest.approx(np.std(r), rel=1e-12)  # ours, verl-omni's flow_dppo
    assert _ratio_stats_of(name, 1, log_ratio) == pytest.approx(np.std(r, ddof=1), rel=1e-12)  # torch.std
    pair = log_ratio[:2]  # a micro-batch of 2: the population std is 1/sqrt(2) of torch.std's
    assert _ratio_stats_of(name, 0, pair) / _ratio_stats_of(name, 1, pair) == pytest.approx(2**-0.5, rel=1e-12)
    assert _ratio_stats_of(name, 1, log_ratio[:1]) == 0.0  # one sample: no spread (torch.std would give nan)


@pytest.mark.parametrize("mode", ["distill_kl", "distill_fm_mse"])
def test_pure_distillation_with_reward_scope_ignores_the_coef(mode: str) -> None:
    """verl-omni's ``loss_mode=distill_kl`` adds its distillation loss without ``distill_loss_coef`` (which weighs
    the term only beside the reward objective, ``use_distill_loss``)."""
    from runtime.rl.algorithms.diffusionopd import Settings, step_objective

    g = torch.Generator().manual_seed(8)
    student = torch.randn((4, 2, 3), generator=g, dtype=torch.float64)
    teacher = student + 0.1 * torch.randn((4, 2, 3), generator=g, dtype=torch.float64)
    std_dev_t = torch.tensor([0.4, 0.6, 0.8, 1.0], dtype=torch.float64).reshape(4, 1, 1)
    sqrt_dt = torch.full((4, 1, 1), 0.3, dtype=torch.float64)
    sq = ((student - teacher) ** 2).mean(dim=(1, 2))
    # verl-omni's DistillKLLoss mean((mu_s - mu_t)^2) / (2 std_dev_t^2), DistillFlowMatchingMSELoss mean((v_s - v_t)^2)
    term = (sq / (2 * std_dev_t.reshape(-1) ** 2)).mean() if mode == "distill_kl" else sq.mean()
    zero = torch.zeros(4, dtype=torch.float64)
    terms = (student, teacher, std_dev_t, sqrt_dt)
    for scope, want in (("with_reward", term), ("always", 0.3 * term)):
        s = Settings(distill_loss_mode=mode, distill_loss_coef=0.3, distill_loss_coef_scope=scope)
        loss, _ = step_objective(s, zero, zero, zero, terms)
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-15)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)  # beside the reward objective: coef under both
    both = [
        step_objective(
            Settings(distill_loss_mode=mode, loss_mode="flow_grpo", distill_loss_coef=0.3, distill_loss_coef_scope=c),
            zero,
            zero,
            adv,
            terms,
        )[0]
        for c in ("always", "with_reward")
    ]
    assert torch.equal(both[0], both[1])


def test_the_defaults_stay_ours_and_the_log_names_the_peers() -> None:
    from runtime.rl.algorithms import dancegrpo, diffusionopd, flowgrpo
    from runtime.rl.correction_config import RolloutCorrectionConfig

    s = flowgrpo.Settings()
    assert (s.adv_clip_max, s.gspo_clip_fraction, s.ratio_std_ddof) == (5.0, "band", 0)
    assert RolloutCorrectionConfig().weighted_terms == "all"
    assert diffusionopd.Settings().distill_loss_coef_scope == "always"
    verl = flowgrpo.Settings(policy_loss_mode="gspo", adv_clip_max=None, gspo_clip_fraction="verl", ratio_std_ddof=1)
    line = flowgrpo.conventions(verl)
    assert "advantages unclamped (verl's gspo)" in line and "low side 0 (verl's gspo)" in line
    assert "ratio_std ddof=1 (verl-omni's" in line
    assert "ratio_std ddof=1" in dancegrpo.conventions(dancegrpo.Settings(ratio_std_ddof=1))
    opd = diffusionopd.Settings(teacher_model_path="t", distill_loss_coef_scope="with_reward", ratio_std_ddof=1)
    assert "beside the reward objective only (verl-omni's)" in diffusionopd.conventions(opd)
    assert "ratio_std ddof=1" in diffusionopd.conventions(opd)


def test_the_keys_are_refused_in_one_line_where_they_do_not_apply(tmp_path: Path) -> None:
    """Parsed only (no pipeline is read: the model path need not exist)."""
    from runtime.config.errors import ConfigError
    from runtime.rl.config import parse_rl_config

    raw = rl_config("flux", tmp_path / "pipeline", tmp_path)
    cases = [
        (
            {"rollout_correction": {"rollout_is": "token", "weighted_terms": "kl"}},
            "rollout_correction.weighted_terms: ",
        ),
        ({"rollout_correction": {"weighted_terms": "policy"}}, "rollout_correction.weighted_terms: only with"),
        ({"flowgrpo": {**raw["flowgrpo"], "ratio_std_ddof": 2}}, "flowgrpo.ratio_std_ddof: 0 (the population"),
        ({"flowgrpo": {**raw["flowgrpo"], "gspo_clip_fraction": "verl"}}, "flowgrpo.gspo_clip_fraction: only with"),
        ({"flowgrpo": {**raw["flowgrpo"], "gspo_clip_fraction": "binds"}}, "flowgrpo.gspo_clip_fraction: unknown"),
    ]
    for change, message in cases:
        with pytest.raises(ConfigError) as err:
            parse_rl_config({**raw, **change})
        assert len(err.value.messages) == 1 and err.value.messages[0].startswith(message), err.value.messages
    opd = for_algorithm(raw, "diffusionopd", loss_mode="flow_grpo", distill_loss_coef_scope="reward")
    with pytest.raises(ConfigError, match=r"^diffusionopd\.distill_loss_coef_scope: unknown value"):
        parse_rl_config(opd)
    dance = for_algorithm(raw, "dancegrpo", ratio_std_ddof=-1)
    with pytest.raises(ConfigError, match=r"^dancegrpo\.ratio_std_ddof: 0 \(the population"):
        parse_rl_config(dance)
    ok = {**raw, "flowgrpo": {**raw["flowgrpo"], "adv_clip_max": None, "policy_loss_mode": "gspo"}}
    ok["flowgrpo"] |= {"gspo_clip_fraction": "verl", "ratio_std_ddof": 1}
    ok["rollout_correction"] = {"rollout_is": "token", "weighted_terms": "policy"}
    config = parse_rl_config(ok)
    assert config.algo.adv_clip_max is None and config.rollout_correction.weighted_terms == "policy"
