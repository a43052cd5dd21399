"""Rollout correction (``runtime/rl/rollout_correction.py``): the weights, masks, loss and gradient against a float64
reference written here from verl's formulas; the identity where the trained policy is the rollout policy; tiny runs
with an off-policy rollout (its log-probs perturbed as another engine's would be): they train, resume bitwise, and
SP=2 equals one process."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.rl.common import assert_resume_is_bitwise, rl_config, tiny_run

CORRECTION = {
    "rollout_is": "token",
    "rollout_is_threshold": 1.1,
    "rollout_rs": "token_k1",
    "rollout_rs_threshold": "0.8_1.25",
}


# ----------------------------------------------------------------------------------------------- the reference
def _reference(old: torch.Tensor, rollout: torch.Tensor, level: str, c: float, rs: str, band: tuple) -> torch.Tensor:
    """verl's rollout_corr_helper, written out: log_ratio = old - rollout; IS = clamp(exp(log_ratio [summed per
    sequence]), max=C); RS k1 statistic -log_ratio [mean per sequence] kept inside [log lower, log upper]."""
    log_ratio = old - rollout
    if level == "token":
        is_w = torch.exp(log_ratio).clamp(max=c)
    else:
        is_w = torch.exp(log_ratio.sum(-1, keepdim=True)).clamp(max=c).expand_as(log_ratio)
    stat = -log_ratio if rs == "token_k1" else (-log_ratio).mean(-1, keepdim=True).expand_as(log_ratio)
    keep = (stat >= math.log(band[0])) & (stat <= math.log(band[1]))
    return is_w * keep


@pytest.mark.parametrize(("level", "rs"), [("token", "token_k1"), ("sequence", "seq_mean_k1")])
def test_weights_masks_loss_and_gradient_match_verls_formulas(level: str, rs: str) -> None:
    from runtime.rl.algorithms import flowgrpo
    from runtime.rl.correction_config import RolloutCorrectionConfig
    from runtime.rl.rollout_correction import correction, weighted_objective

    g = torch.Generator().manual_seed(0)
    old = -1.0 + 0.3 * torch.randn(6, 3, generator=g, dtype=torch.float64)
    rollout = old + 0.2 * torch.randn(6, 3, generator=g, dtype=torch.float64)
    rc = RolloutCorrectionConfig(level, 1.15, rs, "0.8_1.25")
    weights, metrics = correction(old, rollout, rc)
    ref = _reference(old, rollout, level, 1.15, rs, (0.8, 1.25))
    # 1e-12: the same float64 formula, evaluated in another order (sum before exp), differs by a few ulps
    torch.testing.assert_close(weights, ref, rtol=1e-12, atol=1e-12)
    assert 0 < (ref == 0).sum() < ref.numel() and (ref == 1.15).any(), "the draw exercises truncation and rejection"
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx((ref == 0).double().mean().item())
    assert metrics["rollout_corr/kl"] == pytest.approx((rollout - old).mean().item(), rel=1e-12)

    # the loss of one window step (column 1): verl-omni's mean(w * max(-A r, -A clip(r))), and its gradient
    s = flowgrpo.Settings(clip_range=0.05, adv_clip_max=2.0)
    adv = torch.randn(6, generator=g, dtype=torch.float64) * 2
    current = (old[:, 1] + 0.1 * torch.randn(6, generator=g, dtype=torch.float64)).requires_grad_(True)
    loss, _ = weighted_objective(flowgrpo.ALGORITHM, s, weights[:, 1], current, old[:, 1], adv, None, None)
    (grad,) = torch.autograd.grad(loss, current)
    ref_current = current.detach().clone().requires_grad_(True)
    ratio = torch.exp(ref_current - old[:, 1])
    a = adv.clamp(-2.0, 2.0)
    per_elem = torch.maximum(-a * ratio, -a * ratio.clamp(0.95, 1.05))
    ref_loss = (per_elem * ref[:, 1]).mean()
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_current)
    # 1e-12: float64, the same terms summed in another order
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)


def test_on_policy_correction_is_the_identity() -> None:
    """pi_old == pi_rollout: every weight exactly 1, nothing rejected, the loss bitwise the algorithm's own."""
    from runtime.rl.algorithms import flowgrpo
    from runtime.rl.correction_config import RolloutCorrectionConfig
    from runtime.rl.rollout_correction import correction, weighted_objective

    old = torch.randn(4, 2, generator=torch.Generator().manual_seed(1))
    weights, metrics = correction(old, old.clone(), RolloutCorrectionConfig(**CORRECTION))
    assert (weights == 1).all() and metrics["rollout_corr/rollout_rs_masked_fraction"] == 0
    s = flowgrpo.Settings()
    lp, adv = old[:, 0] + 1e-5, torch.randn(4, generator=torch.Generator().manual_seed(2))
    got, _ = weighted_objective(flowgrpo.ALGORITHM, s, weights[:, 0], lp, old[:, 0], adv, None, None)
    want, _ = flowgrpo.ALGORITHM.step_objective(s, lp, old[:, 0], adv, None, None)
    assert torch.equal(got, want)


def test_config_refuses_what_verl_refuses(tiny_pipelines, tmp_path: Path) -> None:
    from runtime.config.errors import ConfigError
    from runtime.rl.config import parse_rl_config

    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path)
    bad = {"rollout_is": "tokens", "rollout_rs": "seq_max_k1"}
    with pytest.raises(ConfigError) as err:
        parse_rl_config({**raw, "rollout_correction": bad})
    text = str(err.value)
    assert "rollout_correction.rollout_is: expected null, token or sequence" in text
    assert "rollout_correction.rollout_rs: expected null or one of" in text
    with pytest.raises(ConfigError, match="rollout_rs_threshold: required with rollout_rs token_k2"):
        parse_rl_config({**raw, "rollout_correction": {"rollout_rs": "token_k2"}})
    with pytest.raises(ConfigError, match="token_k3 takes one upper bound"):
        parse_rl_config({**raw, "rollout_correction": {"rollout_rs": "token_k3", "rollout_rs_threshold": "1_2"}})


# ------------------------------------------------------------------------------------------ tiny runs
def _off_policy(res: Any) -> Any:
    """The rollout's log-probs as another engine's: shifted by a fixed pattern of +-0.25 at most."""
    shift = 0.25 * torch.sin(torch.arange(res.log_probs.numel(), dtype=torch.float32) * 1.7).reshape(
        res.log_probs.shape
    )
    return dataclasses.replace(res, log_probs=res.log_probs + shift)


class _OffPolicyRollout:
    """Patches ``runtime.rl.loop.rollout`` to return off-policy log-probs (restored on exit: pooled workers)."""

    def __enter__(self) -> None:
        from runtime.rl import loop

        self.original = loop.rollout
        loop.rollout = lambda *a, **k: _off_policy(self.original(*a, **k))

    def __exit__(self, *exc: Any) -> None:
        from runtime.rl import loop

        loop.rollout = self.original


def _raw(tiny_pipelines, tmp_path: Path, correction: dict = CORRECTION, **sections: Any) -> dict:
    return rl_config("flux", tiny_pipelines("flux"), tmp_path, rollout_correction=correction, **sections)


def test_on_policy_run_is_the_uncorrected_run_bitwise(tiny_pipelines, tmp_path: Path) -> None:
    """The embedded rollout is the trained policy: the corrected run's weights and metrics are the plain run's."""
    from runtime.rl.loop import iteration
    from tests.rl.common import start, trainable_state

    plain = rl_config("flux", tiny_pipelines("flux"), tmp_path)
    out = []
    for raw in (plain, _raw(tiny_pipelines, tmp_path)):
        run, _ = start(raw)
        metrics = [iteration(run, step)[0] for step in (1, 2)]
        out.append((metrics, trainable_state(run.policy)))
    from runtime.rl.metrics import TIMING_KEYS

    for a, b in zip(out[0][0], out[1][0], strict=True):
        assert b["rollout_corr/rollout_is_mean"] == 1.0 and b["rollout_corr/rollout_rs_masked_fraction"] == 0.0
        assert {k: v for k, v in a.items() if k not in TIMING_KEYS} == {
            k: v for k, v in b.items() if k in a and k not in TIMING_KEYS
        }
    assert all(torch.equal(out[0][1][k], out[1][1][k]) for k in out[0][1])


def test_off_policy_run_trains_and_resumes_bitwise(tiny_pipelines, tmp_path: Path) -> None:
    raw = _raw(tiny_pipelines, tmp_path)
    with _OffPolicyRollout():
        metrics, _ = tiny_run(raw)
        for m in metrics:
            assert 0 < m["rollout_corr/rollout_rs_masked_fraction"] < 1, m
            assert m["rollout_corr/rollout_is_ratio_fraction_high"] > 0, m
            assert m["rollout_corr/rollout_is_max"] <= 1.1
        assert_resume_is_bitwise(raw, tmp_path / "ckpt")


def _off_policy_iteration(rank: int, world_size: int, raw: dict) -> dict:
    from tests.rl.common import one_iteration

    with _OffPolicyRollout():
        return one_iteration(rank, world_size, raw)


@pytest.mark.dist
def test_off_policy_sp2_equals_one_process(tiny_pipelines, tmp_path: Path) -> None:
    from tests.dist_utils import run_distributed
    from tests.rl.common import references
    from tests.rl.test_job_dist import GROUPS_OF_3, _compare

    raw = _raw(
        tiny_pipelines, tmp_path, {**CORRECTION, "rollout_is": "sequence"}, lora={"rank": None}, flowgrpo=GROUPS_OF_3
    )
    ref, witness = references(_off_policy_iteration, raw)
    assert 0 < ref["metrics"]["rollout_corr/rollout_rs_masked_fraction"] < 1
    for got in run_distributed(_off_policy_iteration, 2, {**raw, "parallel": {"sp": 2}}, timeout=300):
        _compare(got, ref, witness)
