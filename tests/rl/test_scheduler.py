import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from runtime.rl.sampling.scheduler import euler_step, gaussian_log_prob, make_schedule, sde_step


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


@pytest.mark.parametrize("config", [{}, {"shift": 3.0}, {"use_dynamic_shifting": True}])
def test_schedule_matches_diffusers(config):
    mu = 0.8 if config.get("use_dynamic_shifting") else None
    sched = make_schedule(config, 10, mu=mu)
    ref = FlowMatchEulerDiscreteScheduler.from_config(config)
    ref.set_timesteps(10, **({"mu": mu} if mu is not None else {}))
    assert torch.equal(sched.sigmas, ref.sigmas) and torch.equal(sched.timesteps, ref.timesteps)
    assert sched.sigmas[-1] == 0 and sched.num_steps == 10
    # a scheduler instance gives the same schedule as its config
    assert torch.equal(make_schedule(ref, 10, mu=mu).sigmas, sched.sigmas)


@pytest.mark.parametrize("name", ["UniPCMultistepScheduler", "DPMSolverMultistepScheduler"])
def test_flow_sigmas_of_a_multistep_scheduler_are_its_own(name):
    """Wan2.1's released scheduler is UniPC with use_flow_sigmas and flow_shift 3.0 (Sana's: DPM-Solver): the rollout
    steps on that scheduler's own shifted grid, not FlowMatchEuler's reading of the config (which ignores flow_shift:
    an unshifted grid, 0.667 where the pipeline has 0.900 at the second of 4 steps)."""
    import diffusers

    cls = getattr(diffusers, name)
    ref = cls(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    ref.set_timesteps(4)
    sched = make_schedule(ref, 4)
    assert torch.equal(sched.sigmas, ref.sigmas.float()) and sched.sigmas[-1] == 0
    assert torch.equal(sched.timesteps, ref.sigmas[:-1].float() * 1000)
    config = {**ref.config, "_class_name": name}  # as scheduler_config.json holds it
    assert torch.equal(make_schedule(config, 4).sigmas, sched.sigmas)
    assert sched.sigmas[1] > 0.89  # shifted (unshifted: 0.667)


def test_a_non_flow_scheduler_is_refused():
    from diffusers import DDIMScheduler, UniPCMultistepScheduler

    with pytest.raises(ValueError, match="DDIMScheduler: the Flow-GRPO SDE step needs a flow-matching schedule"):
        make_schedule(DDIMScheduler(), 4)
    with pytest.raises(ValueError, match="UniPCMultistepScheduler: the Flow-GRPO SDE step needs"):
        make_schedule(UniPCMultistepScheduler(), 4)  # epsilon prediction, no flow sigmas
    with pytest.raises(ValueError, match="pass no sigmas"):
        make_schedule(
            UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction"), 2, sigmas=[1, 0.5]
        )


def test_index_for_timestep_is_checked():
    sched = make_schedule({"shift": 3.0}, 8)
    idx = sched.index_for_timestep(sched.timesteps + 1e-3)  # float noise, e.g. a bf16/fp64 round trip
    assert torch.equal(idx, torch.arange(8))
    with pytest.raises(ValueError, match="not in the schedule"):
        sched.index_for_timestep((sched.timesteps[2] + sched.timesteps[3]) / 2)
    x, v = _rand(2, 4, 3, 3), _rand(2, 4, 3, 3, seed=1)
    by_t = sde_step(sched, x, v, timestep=sched.timesteps[3].item() + 1e-3, prev_sample=x)
    by_i = sde_step(sched, x, v, step_index=3, prev_sample=x)
    assert torch.equal(by_t[1], by_i[1])
    with pytest.raises(ValueError, match="exactly one"):
        sde_step(sched, x, v)


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_noise_level_zero_is_euler_bitwise(shift):
    sched = make_schedule({"shift": shift}, 12)
    x, v = _rand(3, 4, 5, 5), _rand(3, 4, 5, 5, seed=1)
    for i in range(sched.num_steps):
        prev, lp, mean, std, _ = sde_step(sched, x, v, step_index=i, noise_level=0.0)
        assert torch.equal(prev, euler_step(sched, i, x, v)), i
        assert torch.equal(prev, x + v * (sched.sigmas[i + 1] - sched.sigmas[i]))
        assert torch.equal(lp, torch.zeros(3)) and torch.all(std == 0)


def test_cps_noise_level_zero_is_euler():
    sched = make_schedule({"shift": 3.0}, 12)
    x, v = _rand(3, 4, 5, 5), _rand(3, 4, 5, 5, seed=1)
    for i in range(sched.num_steps):
        prev = sde_step(sched, x, v, step_index=i, noise_level=0.0, method="cps")[0]
        torch.testing.assert_close(prev, euler_step(sched, i, x, v), rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", ["sde", "cps"])
def test_noise_standardizes(method):
    sched = make_schedule({"shift": 3.0}, 10)
    x, v = _rand(4, 16, 128, 128), _rand(4, 16, 128, 128, seed=1)  # 1,048,576 elements
    gen = torch.Generator().manual_seed(123)
    prev, _, mean, std, sqrt_dt = sde_step(sched, x, v, step_index=4, noise_level=0.7, method=method, generator=gen)
    z = (prev - mean) / (std * sqrt_dt)
    assert z.numel() >= 1_000_000
    assert abs(z.mean().item()) < 5e-3 and abs(z.std().item() - 1) < 5e-3
    # a seeded generator reproduces the step
    again = sde_step(sched, x, v, step_index=4, noise_level=0.7, method=method, generator=gen.manual_seed(123))
    assert torch.equal(again[0], prev)


@pytest.mark.parametrize("method", ["sde", "cps"])
def test_log_prob_matches_torch_normal(method):
    sched = make_schedule({"shift": 3.0}, 10)
    x, v = _rand(3, 4, 6, 6), _rand(3, 4, 6, 6, seed=1)
    for i in (0, 3, 8):  # includes sigma == 1
        prev, lp, mean, std, sqrt_dt = sde_step(
            sched,
            x,
            v,
            step_index=i,
            method=method,
            noise_level=0.9,
            generator=torch.Generator().manual_seed(i),
            cps_log_prob="gaussian",
        )
        ref = torch.distributions.Normal(mean, (std * sqrt_dt).expand_as(mean)).log_prob(prev).mean(dim=(1, 2, 3))
        torch.testing.assert_close(lp, ref, rtol=0, atol=1e-6)


def test_sde_formula_at_sigma_one_uses_second_sigma():
    sched = make_schedule({"shift": 3.0}, 10)
    assert sched.sigmas[0] == 1
    x, v = _rand(2, 3), _rand(2, 3, seed=1)
    _, _, mean, std, sqrt_dt = sde_step(sched, x, v, step_index=0, noise_level=0.5, prev_sample=x)
    s, s1 = sched.sigmas[0], sched.sigmas[1]
    exp_std = 0.5 * torch.sqrt(s / (1 - s1))
    torch.testing.assert_close(std.reshape(-1), exp_std.expand(2))
    d = s1 - s
    exp_mean = x * (1 + exp_std**2 * d / (2 * s)) + v * (1 + exp_std**2 * (1 - s) / (2 * s)) * d
    torch.testing.assert_close(mean, exp_mean)
    torch.testing.assert_close(sqrt_dt.reshape(-1), torch.sqrt(-d).expand(2))


def _gaussian_velocity(mu, s):
    """Exact marginal velocity E[eps - x0 | x_t = x] for x0 ~ N(mu, s^2), x_t = (1 - t) x0 + t eps."""

    def v(x, t):
        var = (1 - t) ** 2 * s**2 + t**2
        return -mu + (t - (1 - t) * s**2) / var * (x - (1 - t) * mu)

    return v


@pytest.mark.parametrize("noise_level", [0.0, 0.7])
def test_analytic_gaussian_flow_reaches_target(noise_level):
    mu, s = 1.5, 0.5
    vel = _gaussian_velocity(mu, s)
    sched = make_schedule({}, 200)
    assert sched.sigmas[0] == 1 and sched.sigmas[-1] == 0
    gen = torch.Generator().manual_seed(0)
    # x_1 ~ N(0, 1) as exact quantiles, so the check measures the sampler, not the sampling noise of x_1
    n = 64 * 1024
    x = torch.distributions.Normal(0.0, 1.0).icdf((torch.arange(n, dtype=torch.float64) + 0.5) / n).float()
    x = x.reshape(64, 1024)
    for i in range(sched.num_steps):
        v = vel(x, sched.sigmas[i].double()).float()
        x = sde_step(sched, x, v, step_index=i, noise_level=noise_level, generator=gen)[0]
    # measured: ODE mean 1.5000 std 0.4963 (Euler error, -> 0.4993 at 1000 steps); SDE 1.4981 / 0.5016
    assert abs(x.mean().item() - mu) < 0.01 * mu, x.mean().item()
    assert abs(x.std().item() - s) < 0.01 * s, x.std().item()


@pytest.mark.parametrize("method", ["sde", "cps"])
def test_recomputed_log_prob_is_bitwise(method):
    sched = make_schedule({"shift": 3.0}, 10)
    x, v = _rand(4, 4, 8, 8), _rand(4, 4, 8, 8, seed=1)
    gens = [torch.Generator().manual_seed(k) for k in range(4)]
    a = torch.tensor([0.0, 0.7, 0.7, 0.3])
    prev, lp, mean, _, _ = sde_step(sched, x, v, step_index=5, noise_level=a, method=method, generator=gens)
    again = sde_step(sched, x, v, step_index=torch.full((4,), 5), noise_level=a, method=method, prev_sample=prev)
    assert torch.equal(again[1], lp) and torch.equal(again[2], mean)
    # per-sample generators: a sample's noise does not depend on the batch it is in
    solo = sde_step(
        sched,
        x[1:2],
        v[1:2],
        step_index=5,
        noise_level=0.7,
        method=method,
        generator=[torch.Generator().manual_seed(1)],
    )
    assert torch.equal(solo[0], prev[1:2])
    # and a micro-batch split recomputes within 1e-6
    halves = [
        sde_step(
            sched,
            x[k : k + 2],
            v[k : k + 2],
            step_index=5,
            noise_level=a[k : k + 2],
            method=method,
            prev_sample=prev[k : k + 2],
        )[1]
        for k in (0, 2)
    ]
    torch.testing.assert_close(torch.cat(halves), lp, rtol=0, atol=1e-6)


def test_log_prob_has_finite_gradients_and_zero_std_rows():
    mean = _rand(2, 5).requires_grad_()
    std = torch.tensor([[0.0], [0.5]])
    lp = gaussian_log_prob(_rand(2, 5, seed=3), mean, std)
    assert lp[0] == 0
    lp.sum().backward()
    assert torch.isfinite(mean.grad).all() and torch.all(mean.grad[0] == 0)
    assert math.isfinite(lp[1].item())


@pytest.mark.parametrize("method", ["sde", "cps"])
def test_log_prob_gradient_reaches_velocity_only(method):
    sched = make_schedule({"shift": 3.0}, 10)
    x, v = _rand(2, 3, 4, 4), _rand(2, 3, 4, 4, seed=1).requires_grad_()
    prev = _rand(2, 3, 4, 4, seed=2).requires_grad_()
    _, lp, _, _, _ = sde_step(
        sched, x, v, step_index=torch.tensor([1, 7]), noise_level=1.0, method=method, prev_sample=prev
    )
    lp.sum().backward()
    assert torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0
    assert prev.grad is None  # the sample being scored is data, not a function of the policy


def test_bad_arguments_raise():
    sched = make_schedule({}, 4)
    x = _rand(2, 3)
    with pytest.raises(IndexError):
        sde_step(sched, x, x, step_index=4)
    with pytest.raises(ValueError, match="unknown SDE method"):
        sde_step(sched, x, x, step_index=0, method="ddim")
    with pytest.raises(ValueError, match="per-sample"):
        sde_step(sched, x, x, step_index=0, noise_level=torch.ones(3))
    with pytest.raises(ValueError, match="generators"):
        sde_step(sched, x, x, step_index=0, generator=[torch.Generator()])
