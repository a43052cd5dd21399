"""Each convention offered under a peer's name against a float64 re-derivation of that peer's formula, written here
from the peer's description (docs/flowgrpo.md, "Conventions"), not imported from ours: verl-omni's GRPO-Guard scale,
its MixGRPO progressive window, its DanceGRPO KL, the DiffusionNFT optimality weights. Tolerances are relative and
loose enough for any CPU's summation order (the references are float64; ours run in float64 too)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.rl.test_algorithms import _guard_inputs, _log_prob


def _verl_omni_guard(inputs: dict, clip: float, adv_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """verl-omni's GRPO-Guard loss in float64: one scale mean(std_dev_t) * mean(sqrt_dt) for the micro-batch in the
    bias and the rescaling, the micro-batch's mean loss divided by mean(sqrt_dt)^2. (loss, grad w.r.t. the shift)."""
    d = {k: v.double() for k, v in inputs.items()}
    shift = d["delta"].clone().requires_grad_(True)
    s_each = d["std_dev_t"] * d["sqrt_dt"]
    log_ratio = _log_prob(d["x"], d["old_mean"] + shift, s_each) - _log_prob(d["x"], d["old_mean"], s_each)
    scale = d["std_dev_t"].mean() * d["sqrt_dt"].mean()
    bias = shift.pow(2).mean(dim=(1, 2, 3)) / (2 * scale**2)
    ratio = torch.exp((log_ratio + bias) * scale)
    a = d["advantage"].clamp(-adv_max, adv_max)
    per = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip))
    loss = per.mean() / d["sqrt_dt"].mean() ** 2
    (grad,) = torch.autograd.grad(loss, shift)
    return loss.detach(), grad


def _ours_guard(inputs: dict, clip: float, adv_max: float, guard_scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    from runtime.rl.algorithms.grpo_guard import Settings, step_objective

    shift = inputs["delta"].clone().requires_grad_(True)
    mean = inputs["old_mean"] + shift
    s = inputs["std_dev_t"] * inputs["sqrt_dt"]
    settings = Settings(clip_range=clip, adv_clip_max=adv_max, guard_scale=guard_scale)
    gaussian = (mean, inputs["old_mean"], inputs["std_dev_t"], inputs["sqrt_dt"])
    old = _log_prob(inputs["x"], inputs["old_mean"], s)
    loss, _ = step_objective(
        settings, _log_prob(inputs["x"], mean, s), old, inputs["advantage"], None, gaussian=gaussian
    )
    (grad,) = torch.autograd.grad(loss, shift)
    return loss.detach(), grad


def test_grpo_guard_verl_omni_scale_is_verl_omnis() -> None:
    inputs = _guard_inputs(torch.float64)
    ref_loss, ref_grad = _verl_omni_guard(inputs, 0.02, 2.0)
    loss, grad = _ours_guard(inputs, 0.02, 2.0, "verl_omni")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-8, atol=1e-10)
    # a micro-batch of several denoising steps: the per-sample (paper's) loss is another one
    per_sample, _ = _ours_guard(inputs, 0.02, 2.0, "per_sample")
    assert abs(per_sample - ref_loss) > 1e-3 * abs(ref_loss)


def test_grpo_guard_scales_agree_on_one_denoising_step() -> None:
    inputs = _guard_inputs(torch.float64)
    inputs["std_dev_t"] = inputs["std_dev_t"][:1].expand_as(inputs["std_dev_t"]).clone()
    inputs["sqrt_dt"] = inputs["sqrt_dt"][:1].expand_as(inputs["sqrt_dt"]).clone()
    a, ga = _ours_guard(inputs, 0.02, 2.0, "verl_omni")
    b, gb = _ours_guard(inputs, 0.02, 2.0, "per_sample")
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ga, gb, rtol=1e-8, atol=1e-10)


def _verl_omni_window(k: int, envelope: tuple[int, int], size: int, iters_per_group: int) -> int:
    """verl-omni's progressive MixGRPO start at global step ``k`` (from 1): its window envelope ``[a, b)`` (steps
    the window lies in), moved by the window size every ``iters_per_group`` steps, clamped to the last start."""
    first, end = envelope
    return min(first + (k // iters_per_group) * size, end - size)


@pytest.mark.parametrize(
    ("steps", "size", "window_range", "tau"),
    [(16, 3, None, 1), (10, 2, None, 1), (25, 4, [2, 17], 3), (12, 1, [0, 9], 2)],
)
def test_mixgrpo_verl_omni_window_is_verl_omnis(steps: int, size: int, window_range, tau: int) -> None:
    from runtime.rl.algorithms.mixgrpo import Settings, window_start

    s = Settings(sample_strategy="verl_omni", window_size=size, window_range=window_range, iters_per_group=tau)
    lo, hi = window_range or (0, steps - size)
    for k in range(1, 41):
        assert window_start(s, steps, k) == _verl_omni_window(k, (lo, hi + size), size, tau), k


def test_mixgrpo_progressive_with_the_window_stride_is_not_verl_omnis() -> None:
    """The claim docs/flowgrpo.md used to make (verl-omni's window = ours with window_stride = window_size,
    roll_back: false) fails at every one of 40 iterations here: verl-omni never trains the first window and clamps
    its last start off the stride grid."""
    from runtime.rl.algorithms.mixgrpo import Settings, window_start

    s = Settings(window_size=3, window_stride=3, roll_back=False, iters_per_group=1)
    differ = sum(window_start(s, 16, k) != _verl_omni_window(k, (0, 16), 3, 1) for k in range(1, 41))
    assert differ == 40


def _dance_step_pair() -> dict:
    """A policy's and a reference's dance SDE step (ours) on one batch at several steps of a 8-step schedule."""
    from runtime.rl.sampling.scheduler import make_schedule, sde_step

    g = torch.Generator().manual_seed(5)
    schedule = make_schedule(None, 8)
    x = torch.randn(4, 3, 4, 4, generator=g, dtype=torch.float64)
    v, v_ref = torch.randn(2, 4, 3, 4, 4, generator=g, dtype=torch.float64)
    index = torch.tensor([0, 2, 5, 6])
    _, _, mean, std_dev_t, sqrt_dt = sde_step(schedule, x, v, step_index=index, noise_level=0.3, method="dance")
    _, _, ref, _, _ = sde_step(schedule, x, v_ref, step_index=index, noise_level=0.3, method="dance")
    sigmas = schedule.sigmas.double()
    return dict(mean=mean, ref=ref, std_dev_t=std_dev_t, sqrt_dt=sqrt_dt, dt=sigmas[index + 1] - sigmas[index])


def test_dancegrpo_default_kl_is_verl_omnis_exact_kl() -> None:
    """verl-omni's dance_grpo KL: ``mean((mean - ref)^2) / (2 std_dev_t^2)`` with its ``std_dev_t = eta *
    sqrt(-dt)``, batch mean, re-derived here in float64; ours by default (``kl_form: exact``)."""
    from runtime.rl.algorithms import dancegrpo

    d = {k: v.double() for k, v in _dance_step_pair().items()}
    theirs_std = 0.3 * (-d["dt"]).sqrt()
    ref_kl = ((d["mean"] - d["ref"]) ** 2).mean(dim=(1, 2, 3)) / (2 * theirs_std**2)
    settings = dancegrpo.Settings(kl_coef=1.0)
    zero = torch.zeros(4, dtype=torch.float64)
    kl_terms = (d["mean"], d["ref"], d["std_dev_t"], d["sqrt_dt"])
    _, stats = dancegrpo.step_objective(settings, zero, zero, zero, kl_terms)
    torch.testing.assert_close(stats["kl"].double(), ref_kl.mean(), rtol=1e-5, atol=0)  # the step runs in float32
    assert "verl-omni's dance_grpo" in dancegrpo.conventions(settings)
    # the scaled form is the exact KL times -dt per sample, and says so
    scaled = dataclasses.replace(settings, kl_form="scaled")
    _, stats = dancegrpo.step_objective(scaled, zero, zero, zero, kl_terms)
    torch.testing.assert_close(stats["kl"].double(), (ref_kl * -d["dt"]).mean(), rtol=1e-5, atol=0)
    assert "no DanceGRPO peer" in dancegrpo.conventions(scaled)


@pytest.mark.parametrize("eps", [1e-4, 1e-8])
def test_dancegrpo_advantage_eps_is_the_peers(eps: float) -> None:
    """``(r - mean_g) / (std_g + eps)`` with the sample std (verl-omni's 1e-4, the DanceGRPO authors' 1e-8)."""
    from runtime.rl.algorithms import dancegrpo

    rewards = torch.tensor([0.5, 0.50002, 0.49999, 0.50001, 1.0, 2.0, 0.0, 1.5], dtype=torch.float64)
    groups = torch.arange(8) // 4
    ref = torch.empty(8, dtype=torch.float64)
    for g in range(2):
        r = rewards[groups == g]
        ref[groups == g] = (r - r.mean()) / (r.std() + eps)
    got = dancegrpo.advantages(dancegrpo.Settings(advantage_eps=eps), rewards, groups)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)


REWARDS = [0.3, 0.30004, 0.29998, 0.30001, 1.0, 0.2, 0.7, 0.9]


def test_diffusionnft_verl_omni_optimality_is_verl_omnis() -> None:
    """verl-omni's diffusion_nft weights in float64: flow_grpo's advantage (R - mean_g) / (std_batch + 1e-4) with
    torch.std (ddof 1), then r = 1/2 + 1/2 clamp(A / adv_clip_max, -1, 1); ours with reward_std: global,
    reward_norm: adv_clip_max, reward_std_eps: 1e-4. Without the epsilon the group 1e-4 apart saturates."""
    from runtime.rl.algorithms.diffusionnft import Settings, optimality

    r = torch.tensor(REWARDS, dtype=torch.float64)
    groups = torch.arange(8) // 4
    clip = 0.05
    means = torch.stack([r[groups == g].mean() for g in range(2)])[groups]
    ref = 0.5 + 0.5 * ((r - means) / (r.std() + 1e-4) / clip).clamp(-1, 1)
    s = Settings(reward_std="global", reward_norm=clip, reward_std_eps=1e-4)
    torch.testing.assert_close(optimality(s, r, groups), ref, rtol=1e-12, atol=1e-12)


def test_diffusionnft_group_std_ddof_and_epsilon() -> None:
    """The group std with divisor n - ddof (0: np.std, the population std) plus eps, re-derived per group."""
    from runtime.rl.algorithms.diffusionnft import Settings, optimality

    r = torch.tensor(REWARDS, dtype=torch.float64)
    groups = torch.arange(8) // 4
    for ddof in (0, 1):
        for eps in (0.0, 1e-4):
            ref = torch.empty(8, dtype=torch.float64)
            for g in range(2):
                x = r[groups == g]
                z = 1.5 * (((x - x.mean()) ** 2).sum() / (len(x) - ddof)).sqrt() + 1.5 * eps
                ref[groups == g] = 0.5 + 0.5 * ((x - x.mean()) / z).clamp(-1, 1)
            s = Settings(reward_std="group", reward_norm=1.5, reward_std_ddof=ddof, reward_std_eps=eps)
            torch.testing.assert_close(optimality(s, r, groups), ref, rtol=1e-12, atol=1e-12)
    # the group 1e-4 apart: its group std saturates r to 0 or 1 without the epsilon, verl-omni's damps it
    bare = optimality(Settings(reward_std="group"), r, groups)[:4]
    damped = optimality(Settings(reward_std="group", reward_std_eps=1e-4), r, groups)[:4]
    assert (bare - 0.5).abs().max() == 0.5 and (damped - 0.5).abs().max() < 0.2


@pytest.mark.parametrize("unit", ["none", "global", "group"])
def test_diffusionnft_group_or_batch_of_one_is_one_half(unit: str) -> None:
    from runtime.rl.algorithms.diffusionnft import Settings, optimality

    for rewards, groups in (([0.7], [0]), ([0.7, 0.1, 0.4], [0, 1, 2])):
        got = optimality(Settings(reward_std=unit), torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups))
        assert torch.equal(got, torch.full_like(got, 0.5)), (unit, got)


@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_diffusionnft_adaptive_weight_is_verl_omnis(beta: float) -> None:
    """verl-omni's diffusion_nft loss in float64, written in its x0-space terms (x0_hat = x_t - t v_pm, the error
    over its detached mean absolute error floored at 1e-5, times adv_clip_max / beta); ours with adaptive_weight
    and reward_norm = adv_clip_max; loss and gradient."""
    from runtime.rl.algorithms.diffusionnft import Settings, conventions, objective

    g = torch.Generator().manual_seed(3)
    shape = (5, 2, 3, 4)
    x0, eps, v_old, v0 = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4))
    t = torch.tensor([0.05, 0.3, 0.5, 0.8, 0.97], dtype=torch.float64)
    r = torch.tensor([0.0, 0.2, 0.5, 0.9, 1.0], dtype=torch.float64)
    tt = t.reshape(-1, 1, 1, 1)
    xt, target = (1 - tt) * x0 + tt * eps, eps - x0
    clip = 2.0

    def theirs(v: torch.Tensor) -> torch.Tensor:
        pos_pred, neg_pred = beta * v + (1 - beta) * v_old, (1 + beta) * v_old - beta * v
        losses = []
        for pred in (pos_pred, neg_pred):
            x0_hat = xt - tt * pred
            weight = (x0_hat - x0).abs().mean(dim=(1, 2, 3), keepdim=True).clip(min=1e-5).detach()
            losses.append(((x0_hat - x0) ** 2 / weight).mean(dim=(1, 2, 3)))
        return ((r * losses[0] / beta + (1 - r) * losses[1] / beta) * clip).mean()

    v_ref = v0.clone().requires_grad_(True)
    ref = theirs(v_ref)
    (ref_grad,) = torch.autograd.grad(ref, v_ref)
    v = v0.clone().requires_grad_(True)
    settings = Settings(beta=beta, reward_norm=clip, adaptive_weight=True)
    loss, _ = objective(settings, v, v_old, target, r, t)
    (grad,) = torch.autograd.grad(loss, v)
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-8, atol=1e-12)
    assert "verl-omni" in conventions(settings)
