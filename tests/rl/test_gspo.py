"""GSPO's sequence-level ratio (``policy_loss_mode: gspo``, ``runtime/rl/algorithms/objectives.py``,
``runtime/rl/sequence_ratio.py``): the loop's per-step terms summed over a sample's trained steps against a float64
reference written here from the GSPO paper's objective (arXiv:2507.18071: ``s_i = (pi_theta / pi_old)^(1/|y_i|)``,
the geometric mean of the per-step ratios, ``J = mean_i min(s_i A_i, clip(s_i) A_i)``, differentiated as a whole,
without the stop-gradient form), the combinations refused, and tiny Flux runs: 2 iterations that train, resume
bitwise, SP=2 equal to one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.rl.common import assert_resume_is_bitwise, for_algorithm, rl_config, tiny_run
from tests.rl.test_algorithms import _log_prob

B, K, SHAPE = 6, 3, (3, 4, 5)


def _inputs(dtype: torch.dtype) -> dict:
    """K steps of B samples: each step's old mean, a mean shift (row 0 unmoved), its std and the sampled point."""
    g = torch.Generator().manual_seed(7)
    old_mean = torch.randn((K, B, *SHAPE), generator=g, dtype=torch.float64)
    scale = torch.tensor([0.0, 0.004, 0.01, 0.02, 0.05, 0.1], dtype=torch.float64).reshape(1, B, 1, 1, 1)
    delta = scale * torch.randn((K, B, *SHAPE), generator=g, dtype=torch.float64)
    std = 0.2 + 0.5 * torch.rand((K, B, 1, 1, 1), generator=g, dtype=torch.float64)
    x = old_mean + std * torch.randn((K, B, *SHAPE), generator=g, dtype=torch.float64)
    advantage = torch.tensor([1.5, -0.7, 0.4, -2.5, 3.0, -0.9], dtype=torch.float64)
    out = dict(old_mean=old_mean, delta=delta, std=std, x=x, advantage=advantage)
    return {k: v.to(dtype) for k, v in out.items()}


def _step_log_probs(d: dict, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[K, B]`` log-probs of the shifted (current) and the old policy."""
    new = torch.stack([_log_prob(d["x"][k], d["old_mean"][k] + shift[k], d["std"][k]) for k in range(K)])
    old = torch.stack([_log_prob(d["x"][k], d["old_mean"][k], d["std"][k]) for k in range(K)])
    return new, old


def _reference(clip: float, adv_max: float):
    """The paper's sequence objective in float64: (loss, gradient w.r.t. the shifts, the sequence ratios)."""
    d = _inputs(torch.float64)
    shift = d["delta"].clone().requires_grad_(True)
    new, old = _step_log_probs(d, shift)
    s = torch.exp((new - old).sum(dim=0) / K)  # (pi_theta / pi_old)^(1/K) over the sample's K steps
    a = d["advantage"].clamp(-adv_max, adv_max)
    loss = torch.stack([-torch.min(si * ai, si.clamp(1 - clip, 1 + clip) * ai) for si, ai in zip(s, a, strict=True)])
    loss = loss.mean()
    (grad,) = torch.autograd.grad(loss, shift)
    return loss.detach(), grad, s.detach()


def _ours(dtype: torch.dtype, clip: float, adv_max: float):
    """The loop's way: the sequence log-ratio first (no grad), then each step's term, summed with weight 1/K."""
    from runtime.rl.algorithms.flowgrpo import Settings, step_objective

    d = _inputs(dtype)
    shift = d["delta"].clone().requires_grad_(True)
    settings = Settings(clip_range=clip, adv_clip_max=adv_max, policy_loss_mode="gspo")
    with torch.no_grad():
        new, old = _step_log_probs(d, shift)
        seq = (new - old).mean(dim=0)
    new, old = _step_log_probs(d, shift)
    total, stats = 0.0, []
    for k in range(K):
        loss, st = step_objective(settings, new[k], old[k], d["advantage"], None, seq_log_ratio=seq)
        total = total + loss / K
        stats.append(st)
    (grad,) = torch.autograd.grad(total, shift)
    return total.detach(), grad, stats


def _clip_between(s: torch.Tensor) -> float:
    """The geometric mean of the 3rd and 4th smallest ``|s - 1|`` (2x apart here): each is >= 1.4x from it, which no
    float32 rounding (1e-7 relative) crosses, so the same samples clip on every CPU and in both precisions."""
    dev = (s - 1).abs().sort().values
    assert dev[3] > 2 * dev[2] > 0
    return (dev[2] * dev[3]).sqrt().item()


def test_gspo_objective_and_gradient_match_the_paper() -> None:
    _, _, s = _reference(1.0, 2.0)
    clip = _clip_between(s)
    ref_loss, ref_grad, _ = _reference(clip, 2.0)
    loss64, grad64, stats = _ours(torch.float64, clip, 2.0)
    # float64 both sides; the reference sums the log-ratios before exp, ours exps a detached mean and adds the
    # zero-valued gradient carrier: equal up to float64 summation order (1e-12 relative is ~1e4 ulps)
    assert abs(loss64.item() - ref_loss.item()) <= 1e-12 * max(1.0, abs(ref_loss.item()))
    torch.testing.assert_close(grad64, ref_grad, rtol=1e-10, atol=1e-14)  # same reason
    # the clip acts per sample: the same three of six samples at every step (counts, exact)
    assert [round(6 * st["clip_fraction"].item()) for st in stats] == [3, 3, 3]
    loss32, grad32, _ = _ours(torch.float32, clip, 2.0)
    # float32 inputs: log-densities of 60 elements, ~1e-7 relative each; 1e-5 is 100x that
    assert abs(loss32.item() - ref_loss.item()) <= 1e-5 * max(1.0, abs(ref_loss.item()))
    assert ((grad32.double() - ref_grad).norm() / ref_grad.norm()).item() < 1e-5


def test_gspo_differs_from_the_per_step_ratio() -> None:
    """The same inputs under ``vanilla``: each step clipped on its own ratio, another loss and gradient."""
    from runtime.rl.algorithms.flowgrpo import Settings, step_objective

    d = _inputs(torch.float64)
    _, _, s = _reference(1.0, 2.0)
    clip = _clip_between(s)
    ref_loss, _, _ = _reference(clip, 2.0)
    new, old = _step_log_probs(d, d["delta"])
    vanilla = (
        sum(
            step_objective(Settings(clip_range=clip, adv_clip_max=2.0), new[k], old[k], d["advantage"], None)[0]
            for k in range(K)
        )
        / K
    )
    assert abs(vanilla.item() - ref_loss.item()) > 1e-3 * abs(ref_loss.item())


@pytest.mark.parametrize("name", ["grpo_guard", "flowdppo", "diffusionopd"])
def test_gspo_is_refused_where_it_does_not_apply(name: str, tiny_pipelines, tmp_path: Path) -> None:
    from runtime.config.errors import ConfigError
    from runtime.rl.config import parse_rl_config

    raw = for_algorithm(rl_config("flux", tiny_pipelines("flux"), tmp_path), name, policy_loss_mode="gspo")
    with pytest.raises(ConfigError, match=rf"(?m)^{name}\.policy_loss_mode: 'gspo' is a form of"):
        parse_rl_config(raw)
    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path)
    raw["flowgrpo"]["policy_loss_mode"] = "token"
    with pytest.raises(ConfigError, match=r"flowgrpo\.policy_loss_mode"):
        parse_rl_config(raw)


GSPO = {"group_size": 3, "window_size": 2, "adv_clip_max": 0.5, "policy_loss_mode": "gspo", "clip_range": 1e-2}


def _config(tiny_pipelines, tmp_path: Path, name: str = "flowgrpo", **sections) -> dict:
    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path, **sections)
    raw["flowgrpo"] = {}
    return for_algorithm(raw, name, **GSPO)


def test_gspo_trains_on_flux(tiny_pipelines, tmp_path: Path) -> None:
    """One inner epoch in the rollout's layout: the no-grad pass's log-probs are the rollout's bitwise (as the
    training forward's: ``logprob_gap_max`` 0), so every sequence ratio is exactly 1 (exp(0))."""
    metrics, _ = tiny_run(_config(tiny_pipelines, tmp_path))
    assert metrics[0]["logprob_gap_max"] == 0.0 and metrics[0]["seq_ratio_mean"] == 1.0


def test_gspo_mixgrpo_trains_in_micro_batches(tiny_pipelines, tmp_path: Path) -> None:
    """MixGRPO's shared window, micro-batches of 2 of the 6 samples and two inner epochs (the second shuffled): the
    no-grad pass follows the epoch's order and chunks."""
    raw = _config(tiny_pipelines, tmp_path, "mixgrpo")
    raw["mixgrpo"] |= {"micro_batch_size": 2, "inner_epochs": 2, "iters_per_group": 1}
    metrics, _ = tiny_run(raw)
    assert all(m["seq_ratio_mean"] != 1.0 for m in metrics)  # the second epoch moved off 1


def test_gspo_dancegrpo_trains_on_its_subsampled_steps(tiny_pipelines, tmp_path: Path) -> None:
    """DanceGRPO's per-sample subsets: the sequence is each sample's own trained steps; two inner epochs."""
    raw = _config(tiny_pipelines, tmp_path, "dancegrpo")
    raw["dancegrpo"] |= {"timestep_fraction": 0.67, "inner_epochs": 2}
    raw["dancegrpo"].pop("window_size")
    metrics, _ = tiny_run(raw)
    assert all(m["seq_ratio_mean"] != 1.0 for m in metrics)  # the second epoch's weights moved: ratios off 1


def test_gspo_resume_is_bitwise(tiny_pipelines, tmp_path: Path) -> None:
    raw = _config(tiny_pipelines, tmp_path)
    raw["flowgrpo"]["inner_epochs"] = 2
    assert_resume_is_bitwise(raw, tmp_path / "ckpt")


@pytest.mark.dist
def test_gspo_sp2_equals_one_process(tiny_pipelines, tmp_path: Path) -> None:
    """Full fine-tuning under Ulysses SP=2 against one process (test_algorithms' per-algorithm SP=2 test): the loss
    and every gradient within 1e-5, two inner epochs (the second's sequence ratios off 1)."""
    from tests.dist_utils import run_distributed
    from tests.rl.common import one_iteration, references
    from tests.rl.test_job_dist import _compare

    raw = _config(tiny_pipelines, tmp_path, lora={"rank": None})
    raw["flowgrpo"]["inner_epochs"] = 2
    ref, witness = references(one_iteration, raw)
    ranks = run_distributed(one_iteration, 2, {**raw, "parallel": {"sp": 2}}, timeout=300)
    for got in ranks:
        assert got["metrics"]["logprob_gap_max"] <= 1e-6, got["metrics"]["logprob_gap_max"]
        _compare(got, ref, witness)


def test_gspo_under_rollout_correction_takes_the_old_policys_log_probs(tiny_pipelines, tmp_path: Path) -> None:
    """An off-policy rollout (log-probs shifted by up to 0.25, test_rollout_correction's) with verl's decoupled
    correction: the sequence ratio is taken against the recomputed old policy's log-probs, which the no-grad pass
    equals bitwise before any update (same weights, same layout), so every sequence ratio of the single inner epoch
    is exactly 1; against the shifted rollout's it would be off by up to e^0.25."""
    from tests.rl.test_rollout_correction import CORRECTION, _OffPolicyRollout

    raw = _config(tiny_pipelines, tmp_path, rollout_correction=CORRECTION)
    with _OffPolicyRollout():
        metrics, _ = tiny_run(raw)
    assert all(m["seq_ratio_mean"] == 1.0 for m in metrics), [m["seq_ratio_mean"] for m in metrics]
    assert all(0 < m["rollout_corr/rollout_rs_masked_fraction"] < 1 for m in metrics)
