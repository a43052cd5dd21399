"""Both conventions of every place where verl-omni and flow_grpo differ, against float64 formulas written from their
descriptions (not from our code): the advantage std's divisor, the KL's form, the CPS log-prob's form.

* verl-omni normalises a group's rewards with ``torch.std`` (divisor N - 1); flow_grpo with ``np.std`` (divisor N).
* both divide the squared mean difference by ``2 std_dev_t^2``, where the step's std is ``std_dev_t sqrt(-dt)`` for
  the "sde" step: their KL is the exact Gaussian KL times ``-dt``.
* verl-omni's CPS "log-prob" is ``-mean((x - mu)^2)``; the Gaussian one is ``-mean((x - mu)^2 / (2 s^2) + log s +
  log sqrt(2 pi))``.
"""

from __future__ import annotations

import math

import pytest
import torch

from runtime.rl.algorithms.objectives import group_advantages, kl_to_reference
from runtime.rl.sampling.scheduler import make_schedule, sde_step

EPS = 1e-4


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs, ddof):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - ddof))


REWARDS = [0.3, 1.7, -0.4, 0.9, 2.5, 2.0, -1.0, 0.25]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("ddof", [1, 0])
def test_group_std_divisor(ddof):
    expected = []
    for r, g in zip(REWARDS, GROUPS, strict=True):
        members = [x for x, h in zip(REWARDS, GROUPS, strict=True) if h == g]
        expected.append((r - _mean(members)) / (_std(members, ddof) + EPS))
    adv = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), torch.tensor(GROUPS), "group", EPS, ddof=ddof)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=2e-7)


@pytest.mark.parametrize("ddof", [1, 0])
def test_global_std_divisor(ddof):
    expected = []
    for r, g in zip(REWARDS, GROUPS, strict=True):
        members = [x for x, h in zip(REWARDS, GROUPS, strict=True) if h == g]
        expected.append((r - _mean(members)) / (_std(REWARDS, ddof) + EPS))
    adv = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), torch.tensor(GROUPS), "global", EPS, ddof=ddof)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=2e-7)


def test_default_is_verl_omni_and_ratio_is_sqrt_g_over_g_minus_1():
    r, g = torch.tensor(REWARDS), torch.tensor(GROUPS)
    assert torch.equal(group_advantages(r, g, "group"), group_advantages(r, g, "group", ddof=1))
    ratio = group_advantages(r, g, "group", eps=0.0, ddof=0) / group_advantages(r, g, "group", eps=0.0, ddof=1)
    torch.testing.assert_close(ratio, torch.full((8,), math.sqrt(4 / 3)))
    # a group of one sample has advantage 0 under both (its mean is itself)
    for ddof in (0, 1):
        single = group_advantages(torch.tensor([1.0, 2.0, 5.0]), torch.tensor([0, 0, 1]), "group", ddof=ddof)
        assert single[2].item() == 0.0 and torch.isfinite(single).all()
    with pytest.raises(ValueError, match="ddof"):
        group_advantages(r, g, ddof=2)


def _sde_facts(sched, i, a):
    """float64 std_dev_t and -dt of the Flow-GRPO "sde" step i (the paper's formula)."""
    s, s_next = float(sched.sigmas[i]), float(sched.sigmas[i + 1])
    s_den = float(sched.sigmas[1]) if s == 1 else s
    return a * math.sqrt(s / (1 - s_den)), s - s_next


@pytest.mark.parametrize("step", [0, 3, 8])
def test_sde_kl_scaled_is_exact_times_minus_dt(step):
    sched = make_schedule({"shift": 3.0}, 10)
    g = torch.Generator().manual_seed(step)
    x, v, v_ref = (torch.randn(3, 4, 5, 5, generator=g) for _ in range(3))
    a = 0.7
    _, _, mean, std_dev_t, sqrt_dt = sde_step(sched, x, v, step_index=step, noise_level=a, prev_sample=x)
    _, _, ref_mean, _, _ = sde_step(sched, x, v_ref, step_index=step, noise_level=a, prev_sample=x)
    std_t, minus_dt = _sde_facts(sched, step, a)
    sq = ((mean.double() - ref_mean.double()) ** 2).mean(dim=(1, 2, 3))
    exact = (sq / (2 * std_t**2 * minus_dt)).mean().item()  # KL(N(m, s^2) || N(m', s^2)) per element, s^2 = std^2 dt
    scaled = (sq / (2 * std_t**2)).mean().item()
    assert kl_to_reference(mean, ref_mean, std_dev_t, sqrt_dt, "exact").item() == pytest.approx(exact, rel=2e-5)
    assert kl_to_reference(mean, ref_mean, std_dev_t, sqrt_dt, "scaled").item() == pytest.approx(scaled, rel=2e-5)
    assert kl_to_reference(mean, ref_mean, std_dev_t, sqrt_dt).item() == pytest.approx(scaled, rel=2e-5)
    assert scaled == pytest.approx(exact * minus_dt, rel=1e-12)


def test_scaled_kl_is_3_7x_to_112x_smaller_at_10_steps():
    """The issue's figure: over the 10 steps of a shift-3 schedule, -dt ranges from 1/3.7 to 1/112."""
    sched = make_schedule({"shift": 3.0}, 10)
    factors = [1 / float(sched.sigmas[i] - sched.sigmas[i + 1]) for i in range(10)]
    assert min(factors) == pytest.approx(3.7, abs=0.05) and max(factors) == pytest.approx(112, rel=0.01)


def _cps_mean(sched, i, a, x, v):
    """float64 CPS mean: (1 - s') x0 + sqrt(s'^2 - std^2) eps with std = s' sin(a pi / 2)."""
    s, s_next = float(sched.sigmas[i]), float(sched.sigmas[i + 1])
    std = s_next * math.sin(a * math.pi / 2)
    x, v = x.double(), v.double()
    x0, eps = x - s * v, x + (1 - s) * v
    return (1 - s_next) * x0 + math.sqrt(max(s_next**2 - std**2, 0.0)) * eps, std


@pytest.mark.parametrize("step", [1, 6])
def test_cps_log_prob_forms(step):
    sched = make_schedule({"shift": 3.0}, 10)
    g = torch.Generator().manual_seed(10 + step)
    x, v, prev = (torch.randn(2, 4, 6, 6, generator=g) for _ in range(3))
    a = 0.8
    mu, std = _cps_mean(sched, step, a, x, v)
    d2 = (prev.double() - mu) ** 2
    squared_error = (-d2).mean(dim=(1, 2, 3))
    gaussian = (-d2 / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2, 3))
    kw = dict(step_index=step, noise_level=a, method="cps", prev_sample=prev)
    default = sde_step(sched, x, v, **kw)[1]
    torch.testing.assert_close(default.double(), squared_error, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sde_step(sched, x, v, cps_log_prob="squared_error", **kw)[1], default, rtol=0, atol=0)
    torch.testing.assert_close(
        sde_step(sched, x, v, cps_log_prob="gaussian", **kw)[1].double(), gaussian, rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="CPS log-prob"):
        sde_step(sched, x, v, cps_log_prob="mse", **kw)


def test_sde_log_prob_is_the_full_gaussian_in_both_peers():
    """verl-omni (include_logprob_normalizer=True by default) and flow_grpo both keep the normaliser for "sde"."""
    sched = make_schedule({"shift": 3.0}, 10)
    g = torch.Generator().manual_seed(3)
    x, v, prev = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(3))
    std_t, minus_dt = _sde_facts(sched, 4, 0.7)
    s, dt = float(sched.sigmas[4]), -minus_dt
    xd, vd = x.double(), v.double()
    mean = xd * (1 + std_t**2 * dt / (2 * s)) + vd * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    total = std_t * math.sqrt(minus_dt)
    expected = (-((prev.double() - mean) ** 2) / (2 * total**2) - math.log(total) - 0.5 * math.log(2 * math.pi)).mean(
        dim=(1, 2, 3)
    )
    got = sde_step(sched, x, v, step_index=4, noise_level=0.7, prev_sample=prev)[1]
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_make_schedule_takes_the_pipelines_sigmas():
    """Flux / Qwen-Image pass linspace(1, 1/N, N) and a resolution shift mu; diffusers shifts them. Our schedule of
    the same call equals a hand-computed float64 exponential time shift to fp32 rounding."""
    n, mu = 6, 0.77
    base = [1.0 - k * (1 - 1 / n) / (n - 1) for k in range(n)]
    sched = make_schedule({"use_dynamic_shifting": True, "time_shift_type": "exponential"}, n, mu=mu, sigmas=base)
    shifted = [math.exp(mu) / (math.exp(mu) + (1 / s - 1)) for s in base] + [0.0]
    torch.testing.assert_close(sched.sigmas.double(), torch.tensor(shifted, dtype=torch.float64), rtol=0, atol=1e-6)
    grid = make_schedule({"use_dynamic_shifting": True, "time_shift_type": "exponential"}, n, mu=mu)
    assert not torch.equal(grid.sigmas, sched.sigmas)  # the scheduler's own grid is another schedule
    with pytest.raises(ValueError, match="sigmas"):
        make_schedule({}, n + 1, sigmas=base)
