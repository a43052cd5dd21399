"""Flow-DPPO (``runtime/rl/algorithms/flowdppo.py``): its objective and gradient against a float64 reference written
here from verl-omni's ``flow_dppo`` formula (docs/algo/flowdppo.md: ``D = mean((mu - mu_old)^2) / (2 s^2)``, a
sample's step dropped when ``D >= kl_mask_threshold`` and it moves away: ``A > 0, r > 1`` or ``A < 0, r < 1``;
the loss the mean of ``-A r`` over the kept ones, advantages unclamped), its config refusals, and a 2-iteration run
on the tiny Flux pipeline whose second inner epoch masks. Resume and SP=2 are ``test_algorithms.py``'s
per-algorithm tests (``SECTIONS``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.rl.test_algorithms import _guard_inputs, _log_prob, _tiny_run


def _divergence(shift: torch.Tensor, s: torch.Tensor, coefficient: bool) -> torch.Tensor:
    sq = shift.detach().pow(2).mean(dim=(1, 2, 3))
    return sq / (2 * s.reshape(-1) ** 2) if coefficient else sq / 2


def _reference(inputs: dict, threshold: float, coefficient: bool):
    """verl-omni's Flow-DPPO loss in float64: (loss, gradient w.r.t. the mean shift, the masked rows)."""
    d = {k: v.double() for k, v in inputs.items()}
    shift = d["delta"].clone().requires_grad_(True)
    s = d["std_dev_t"] * d["sqrt_dt"]
    ratio = (_log_prob(d["x"], d["old_mean"] + shift, s) - _log_prob(d["x"], d["old_mean"], s)).exp()
    a = d["advantage"]
    far = _divergence(shift, s, coefficient) >= threshold
    masked = [bool(f and ((ai > 0 and r > 1) or (ai < 0 and r < 1))) for f, ai, r in zip(far, a, ratio, strict=True)]
    terms = [torch.zeros((), dtype=torch.float64) if m else -ai * r for m, ai, r in zip(masked, a, ratio, strict=True)]
    loss = torch.stack(terms).mean()
    (grad,) = torch.autograd.grad(loss, shift)
    return loss.detach(), grad, masked


def _ours(inputs: dict, threshold: float, coefficient: bool, adv_clip_max: float | None = None):
    from runtime.rl.algorithms.flowdppo import Settings, step_objective

    shift = inputs["delta"].clone().requires_grad_(True)
    mean = inputs["old_mean"] + shift
    s = inputs["std_dev_t"] * inputs["sqrt_dt"]
    settings = Settings(kl_mask_threshold=threshold, add_kl_coefficient=coefficient, adv_clip_max=adv_clip_max)
    gaussian = (mean, inputs["old_mean"], inputs["std_dev_t"], inputs["sqrt_dt"])
    log_prob, old = _log_prob(inputs["x"], mean, s), _log_prob(inputs["x"], inputs["old_mean"], s)
    loss, stats = step_objective(settings, log_prob, old, inputs["advantage"], None, gaussian=gaussian)
    (grad,) = torch.autograd.grad(loss, shift)
    return loss.detach(), grad, stats


def _threshold(inputs: dict, coefficient: bool) -> float:
    """The geometric mean of the 3rd and 4th smallest divergences: every comparison is far from the threshold (the
    divergences of these inputs are spread over decades), so no rounding can flip a mask."""
    d = {k: v.double() for k, v in inputs.items()}
    div = _divergence(d["delta"], d["std_dev_t"] * d["sqrt_dt"], coefficient).sort().values
    assert div[3] > 10 * div[2]
    return (div[2] * div[3]).sqrt().item()


@pytest.mark.parametrize("coefficient", [True, False])
def test_flowdppo_objective_and_gradient_match_verl_omnis_formula(coefficient: bool) -> None:
    inputs64 = _guard_inputs(torch.float64)
    threshold = _threshold(inputs64, coefficient)
    ref_loss, ref_grad, masked = _reference(inputs64, threshold, coefficient)
    assert 0 < sum(masked) < 3  # the inputs mask some of the 3 far rows and keep a corrective one
    loss64, grad64, stats = _ours(inputs64, threshold, coefficient)
    # float64 both sides, the same terms summed in another order: 1e-12 relative is ~1e4 ulps of headroom
    assert abs(loss64.item() - ref_loss.item()) <= 1e-12 * max(1.0, abs(ref_loss.item()))
    torch.testing.assert_close(grad64, ref_grad, rtol=1e-10, atol=1e-14)  # same: float64 summation order only
    # fractions are float32 means of 0/1 flags: the counts times 6 round back exactly
    assert round(6 * stats["dppo/masked_fraction"].item()) == sum(masked)
    assert round(6 * stats["dppo/kl_mask_fraction"].item()) == 3
    loss32, grad32, _ = _ours(_guard_inputs(torch.float32), threshold, coefficient)
    # float32 inputs: log-densities of 60 elements differ from float64's by ~1e-7 relative; 1e-5 is 100x that
    assert abs(loss32.item() - ref_loss.item()) <= 1e-5 * max(1.0, abs(ref_loss.item()))
    assert ((grad32.double() - ref_grad).norm() / ref_grad.norm()).item() < 1e-5


def test_flowdppo_masks_verl_omnis_four_cases() -> None:
    """verl-omni's own case (its CPU test's inputs): ratios 1.2 / 0.8 with advantages +-10 and +-8, every sample far
    (D = 0.16 / (2 * 0.25^2) = 1.28): the first two move away and are masked, the last two are corrective and kept;
    the advantages are not clamped (its loss differs from the clamped one)."""
    ratio = torch.tensor([1.2, 0.8, 1.2, 0.8], dtype=torch.float64)
    adv = torch.tensor([10.0, -10.0, -8.0, 8.0], dtype=torch.float64)
    old_mean = torch.zeros((4, 2, 2, 2), dtype=torch.float64)
    mean = torch.full_like(old_mean, 0.2)
    std_dev_t, sqrt_dt = torch.full((4, 1, 1, 1), 0.5, dtype=torch.float64), torch.full((4,), 0.5, dtype=torch.float64)
    from runtime.rl.algorithms.flowdppo import Settings, step_objective

    log_prob = ratio.log().requires_grad_(True)
    zero = torch.zeros(4, dtype=torch.float64)
    loss, stats = step_objective(Settings(), log_prob, zero, adv, None, gaussian=(mean, old_mean, std_dev_t, sqrt_dt))
    expected = (8.0 * 1.2 - 8.0 * 0.8) / 4  # -A r of the two kept samples, over all four
    assert loss.item() == pytest.approx(expected, rel=1e-12)  # float64: a few ulps
    assert stats["dppo/masked_fraction"].item() == 0.5 and stats["dppo/kl_mask_fraction"].item() == 1.0
    assert stats["dppo/pos_rm_fraction"].item() == 0.25 and stats["dppo/neg_rm_fraction"].item() == 0.25
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert grad[:2].eq(0).all() and grad[2:].ne(0).all()  # masked rows get no gradient: exactly 0 by the mask
    clamped, _ = step_objective(
        Settings(adv_clip_max=5.0), log_prob, zero, adv, None, gaussian=(mean, old_mean, std_dev_t, sqrt_dt)
    )
    assert clamped.item() == pytest.approx((5.0 * 1.2 - 5.0 * 0.8) / 4, rel=1e-12)


def test_flowdppo_config_refusals(tiny_pipelines, tmp_path: Path) -> None:
    from runtime.config.errors import ConfigError
    from runtime.rl.config import algorithm, parse_rl_config
    from tests.rl.common import for_algorithm, rl_config

    raw = for_algorithm(rl_config("flux", tiny_pipelines("flux"), tmp_path), "flowdppo")
    raw["flowdppo"] |= {"clip_range": 1e-4, "sde_type": "cps", "kl_mask_threshold": 0.0}
    with pytest.raises(ConfigError) as info:
        parse_rl_config(raw)
    text = "\n".join(info.value.messages)
    assert "flowdppo.kl_mask_threshold: must be positive" in text, text
    raw["flowdppo"]["kl_mask_threshold"] = 1e-5
    with pytest.raises(ConfigError) as info:
        parse_rl_config(raw)
    text = "\n".join(info.value.messages)
    assert "flowdppo.clip_range: Flow-DPPO has no ratio clip" in text and "flowdppo.sde_type:" in text, text
    raw["flowdppo"] = {k: v for k, v in raw["flowdppo"].items() if k not in ("clip_range", "sde_type")}
    raw["flowdppo"]["noise_level"] = 0.0
    with pytest.raises(ConfigError, match=r"flowdppo\.noise_level: 0"):
        parse_rl_config(raw)
    raw["flowdppo"].pop("noise_level")
    config = parse_rl_config(raw)
    assert config.algo.kl_mask_threshold == 1e-5 and config.algo.add_kl_coefficient
    assert "verl-omni's flow_dppo" in algorithm("flowdppo").conventions(config.algo)


def test_flowdppo_trains_on_flux(tiny_pipelines, tmp_path: Path) -> None:
    """Two inner epochs: the first has D = 0 (the old means are its own) and masks nothing; the second reads them as
    the old policy's, so its divergences are > 0 and, at a threshold below them, samples moving away are masked."""
    section = {"inner_epochs": 2, "kl_mask_threshold": 1e-12, "adv_clip_max": 0.5}
    metrics, _ = _tiny_run(tiny_pipelines, tmp_path, "flowdppo", section)
    assert metrics[0]["logprob_gap_max"] == 0.0
    for m in metrics:
        assert m["dppo/kl_new_old_mean"] > 0 and 0 < m["dppo/kl_mask_fraction"] <= 0.5, m
        # the averages over both epochs: the first masks nothing; after one update every sample's ratio has moved with
        # its advantage (away), so the second masks up to all of them
        assert 0 < m["dppo/masked_fraction"] <= 0.5, m
