"""The algorithms beyond Flow-GRPO (``runtime/rl/algorithms``): each objective and its gradients against a float64
reference written here from the paper's formulas (not from the module), and a 2-iteration run on the tiny Flux
pipeline that trains (the trainable parameters change, every loss finite).

GRPO-Guard's reference: with ``x = mu_old + s * eps`` the RatioNorm log-ratio ``(log p_theta - log p_old + b) * s``
is, by expanding the two Gaussian log-densities, exactly ``mean(eps * (mu_theta - mu_old))``; the reference uses
that closed form, and ``torch.distributions.Normal`` for the un-normalised ratio.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.rl.common import assert_resume_is_bitwise, for_algorithm, rl_config, tiny_run

SHAPE = (6, 3, 4, 5)  # [B, C, H, W]


def _guard_inputs(dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(11)
    b = SHAPE[0]
    old_mean = torch.randn(SHAPE, generator=g, dtype=torch.float64)
    scale = torch.tensor([0.0, 0.003, 0.03, 0.1, 0.5, 2.0], dtype=torch.float64).reshape(b, 1, 1, 1)
    delta = scale * torch.randn(SHAPE, generator=g, dtype=torch.float64)
    std_dev_t = 0.3 + torch.rand((b, 1, 1, 1), generator=g, dtype=torch.float64)
    sqrt_dt = (0.05 + 0.4 * torch.rand((b, 1, 1, 1), generator=g, dtype=torch.float64)).sqrt()
    eps = torch.randn(SHAPE, generator=g, dtype=torch.float64)
    advantage = torch.tensor([1.5, -0.7, 0.4, -2.5, 3.0, 0.9], dtype=torch.float64)
    x = old_mean + std_dev_t * sqrt_dt * eps
    cast = {k: v.to(dtype) for k, v in dict(old_mean=old_mean, delta=delta, std_dev_t=std_dev_t).items()}
    cast.update(sqrt_dt=sqrt_dt.to(dtype), eps=eps.to(dtype), advantage=advantage.to(dtype), x=x.to(dtype))
    return cast


def _log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x).mean(dim=(1, 2, 3))


def _reference(inputs: dict, clip: float, adv_max: float, ratio_norm: bool, reweight: bool):
    """The paper's objective in float64; (loss, gradient w.r.t. the mean shift)."""
    d = {k: v.double() for k, v in inputs.items()}
    shift = d["delta"].clone().requires_grad_(True)
    s = d["std_dev_t"] * d["sqrt_dt"]
    if ratio_norm:
        log_ratio = (d["eps"] * shift).mean(dim=(1, 2, 3))
    else:
        log_ratio = _log_prob(d["x"], d["old_mean"] + shift, s) - _log_prob(d["x"], d["old_mean"], s)
    rho = log_ratio.exp()
    a = d["advantage"].clamp(-adv_max, adv_max)
    per = torch.stack([torch.max(-ai * r, -ai * r.clamp(1 - clip, 1 + clip)) for ai, r in zip(a, rho, strict=True)])
    if reweight:
        per = per / d["sqrt_dt"].reshape(-1) ** 2
    loss = per.mean()
    (grad,) = torch.autograd.grad(loss, shift)
    return loss.detach(), grad


def _ours(inputs: dict, clip: float, adv_max: float, ratio_norm: bool, reweight: bool):
    from runtime.rl.algorithms.grpo_guard import Settings, step_objective

    shift = inputs["delta"].clone().requires_grad_(True)
    mean = inputs["old_mean"] + shift
    s = inputs["std_dev_t"] * inputs["sqrt_dt"]
    log_prob = _log_prob(inputs["x"], mean, s)
    old_log_prob = _log_prob(inputs["x"], inputs["old_mean"], s)
    settings = Settings(clip_range=clip, adv_clip_max=adv_max, ratio_norm=ratio_norm, grad_reweight=reweight)
    gaussian = (mean, inputs["old_mean"], inputs["std_dev_t"], inputs["sqrt_dt"])
    loss, stats = step_objective(settings, log_prob, old_log_prob, inputs["advantage"], None, gaussian=gaussian)
    (grad,) = torch.autograd.grad(loss, shift)
    return loss.detach(), grad, stats


@pytest.mark.parametrize(("ratio_norm", "reweight"), [(True, True), (True, False), (False, True), (False, False)])
def test_grpo_guard_objective_and_gradient_match_the_paper(ratio_norm: bool, reweight: bool) -> None:
    clip, adv_max = 0.02, 2.0
    ref_loss, ref_grad = _reference(_guard_inputs(torch.float64), clip, adv_max, ratio_norm, reweight)
    loss64, grad64, stats = _ours(_guard_inputs(torch.float64), clip, adv_max, ratio_norm, reweight)
    assert abs(loss64.item() - ref_loss.item()) <= 1e-10 * max(1.0, abs(ref_loss.item()))
    assert torch.allclose(grad64, ref_grad, rtol=1e-9, atol=1e-12)
    assert 0 < stats["clip_fraction"].item() < 1  # the inputs exercise both sides of the clip
    loss32, grad32, _ = _ours(_guard_inputs(torch.float32), clip, adv_max, ratio_norm, reweight)
    assert abs(loss32.item() - ref_loss.item()) <= 1e-5 * max(1.0, abs(ref_loss.item()))
    assert ((grad32.double() - ref_grad).norm() / ref_grad.norm()).item() < 1e-5


def test_grpo_guard_ratio_is_centred_where_flowgrpos_is_left_shifted() -> None:
    """The paper's observation and its fix, measured: over many noise draws for one fixed mean shift, Flow-GRPO's
    log-ratio averages ``-b`` (< 0), RatioNorm's averages 0 with the same spread at every noise level."""
    from runtime.rl.algorithms.grpo_guard import guard_loss

    g = torch.Generator().manual_seed(3)
    n, dims = 4000, (1, 8, 8)
    old_mean = torch.randn((n, *dims), generator=g, dtype=torch.float64)
    shift = 0.05 * torch.randn((1, *dims), generator=g, dtype=torch.float64).expand(n, *dims)
    spreads = []
    for std in (0.05, 0.5):
        s = torch.full((n, 1, 1, 1), std, dtype=torch.float64)
        x = old_mean + s * torch.randn((n, *dims), generator=g, dtype=torch.float64)
        lp, lp_old = _log_prob(x, old_mean + shift, s), _log_prob(x, old_mean, s)
        plain = lp - lp_old
        bias = (shift**2).mean(dim=(1, 2, 3)) / (2 * s.reshape(-1) ** 2)
        assert plain.mean().item() < -0.5 * bias[0].item()  # left-shifted by ~b
        ones = torch.ones(n, dtype=torch.float64)
        _, stats = guard_loss(
            lp,
            lp_old,
            ones,
            old_mean + shift,
            old_mean,
            s,
            ones.reshape(-1, 1, 1, 1),
            clip_range=1.0,
            adv_clip_max=5.0,
        )
        log_norm = (lp - lp_old + bias) * s.reshape(-1)
        assert abs(log_norm.mean().item()) < 4 * log_norm.std().item() / math.sqrt(n)  # centred
        assert stats["guard/ratio_mean_bias"].item() == pytest.approx(bias[0].item(), rel=1e-12)
        spreads.append(log_norm.std().item())
    assert spreads[0] == pytest.approx(spreads[1], rel=0.1)  # one scale at every noise level


def test_grpo_guard_config_names_its_section(tiny_pipelines, tmp_path: Path) -> None:
    from runtime.config.errors import ConfigError
    from runtime.rl.config import parse_rl_config

    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path, algorithm="grpo_guard")
    raw["grpo_guard"] = {**raw.pop("flowgrpo"), "sde_type": "cps", "window_size": 9}
    with pytest.raises(ConfigError) as info:
        parse_rl_config(raw)
    messages = info.value.messages
    assert any(m.startswith("grpo_guard.window_size:") for m in messages), messages
    raw["grpo_guard"].pop("window_size")
    with pytest.raises(ConfigError, match=r"^grpo_guard\.sde_type: .*cps"):
        parse_rl_config(raw)
    raw["grpo_guard"]["sde_type"] = "sde"
    config = parse_rl_config(raw)
    assert config.algo.clip_range == 2e-6 and config.algo.ratio_norm and config.algo.grad_reweight


def _tiny_run(tiny_pipelines, tmp_path: Path, algorithm: str, section: dict) -> tuple[list[dict], list]:
    """Two checked iterations (``tiny_run``) of ``algorithm`` on the tiny Flux pipeline."""
    return tiny_run(for_algorithm(rl_config("flux", tiny_pipelines("flux"), tmp_path), algorithm, **section))


def test_grpo_guard_trains_on_flux(tiny_pipelines, tmp_path: Path) -> None:
    """Two inner epochs: the second reads the first epoch's means as the old policy's, so its bias term is > 0."""
    metrics, _ = _tiny_run(tiny_pipelines, tmp_path, "grpo_guard", {"inner_epochs": 2, "clip_range": 1e-2})
    assert metrics[0]["logprob_gap_max"] == 0.0
    assert all(m["guard/ratio_mean_bias"] > 0 for m in metrics), metrics


def _paper_window(k: int, lo: int, hi: int, stride: int, tau: int, roll_back: bool) -> int:
    """MixGRPO's sliding window as the paper runs it: start at ``lo``; every ``tau`` iterations move by ``stride``;
    past ``hi`` go back to ``lo`` (roll back) or stay at the last position."""
    start = lo
    for done in range(1, k):
        if done % tau == 0:
            if start + stride <= hi:
                start += stride
            elif roll_back:
                start = lo
    return start


@pytest.mark.parametrize(
    ("steps", "size", "window_range", "stride", "tau", "roll_back"),
    [(25, 4, None, 1, 25, True), (10, 2, [0, 5], 2, 3, True), (10, 2, [1, 7], 3, 2, False), (4, 2, None, 5, 1, True)],
)
def test_mixgrpo_window_slides_as_the_paper_says(steps, size, window_range, stride, tau, roll_back) -> None:
    from runtime.rl.algorithms.mixgrpo import Settings, window

    s = Settings(
        window_size=size, window_range=window_range, window_stride=stride, iters_per_group=tau, roll_back=roll_back
    )
    lo, hi = window_range or (0, steps - size)
    for k in range(1, 200):
        expected = _paper_window(k, lo, hi, stride, tau, roll_back)
        assert window(s, steps, k) == (size, (expected, expected)), k


@pytest.mark.parametrize(
    ("steps", "size", "stride", "tau", "k", "start", "roll_back"),
    [
        (25, 4, 1, 25, 0.1, 13, True),  # the authors' Flux recipe with their exp_decay defaults
        (25, 4, 1, 5, 0.3, 4, False),
        (12, 2, 3, 4, 5.0, 0, True),  # tau falls to its floor of 1 right away
    ],
)
def test_mixgrpo_exp_decay_window_follows_the_shift_interval_rule(steps, size, stride, tau, k, start, roll_back):
    """The exponential-decay shift interval ``tau(l) = ceil(tau_0 exp(-k relu(l - l_thr)))`` (at least 1), run as the
    authors' state machine: after each iteration count it, and once the count reaches ``tau`` of the current start,
    move by the stride (past the last start: back to the first, or stay)."""
    from runtime.rl.algorithms.mixgrpo import Settings, window_start

    s = Settings(
        window_size=size,
        window_stride=stride,
        iters_per_group=tau,
        roll_back=roll_back,
        sample_strategy="exp_decay",
        decay_k=k,
        decay_start=start,
    )
    hi = steps - size
    last = (hi // stride) * stride
    cur, count, seen = 0, 0, set()
    for iteration in range(1, 600):
        assert window_start(s, steps, iteration) == cur, iteration
        seen.add(cur)
        count += 1
        if count >= max(1, math.ceil(tau * math.exp(-k * max(0, cur - start)))):
            count, cur = 0, cur + stride
            if cur > hi:
                cur = 0 if roll_back else last
    assert seen == set(range(0, hi + 1, stride))


def test_mixgrpo_random_window_is_seeded_and_covers_the_range() -> None:
    from runtime.rl.algorithms.mixgrpo import Settings, window_start

    s = Settings(sample_strategy="random", window_range=[1, 4], window_seed=3)
    starts = [window_start(s, 10, k) for k in range(1, 101)]
    assert set(starts) == {1, 2, 3, 4} and starts == [window_start(s, 10, k) for k in range(1, 101)]
    assert starts != [
        window_start(Settings(sample_strategy="random", window_range=[1, 4]), 10, k) for k in range(1, 101)
    ]


def test_mixgrpo_trains_on_flux(tiny_pipelines, tmp_path: Path) -> None:
    """Every sample of an iteration shares the window, which moves by the stride after each iteration (tau 1)."""
    metrics, rollouts = _tiny_run(
        tiny_pipelines, tmp_path, "mixgrpo", {"iters_per_group": 1, "window_stride": 1, "window_size": 2}
    )
    assert [m["window_start"] for m in metrics] == [0, 1]
    for first, res in zip((0, 1), rollouts, strict=True):
        assert torch.equal(res.step_indices, torch.tensor([[first, first + 1]] * 4))
    assert metrics[0]["logprob_gap_max"] == 0.0 and metrics[0]["ratio_mean"] == 1.0


def test_dancegrpo_sde_step_and_gradient_match_the_paper() -> None:
    """DanceGRPO's step ``dz = [v - eta^2 / 2 * score] dt + eta dw`` (Euler-Maruyama, ``score = -(z - (1 - t)
    x0_hat) / t^2``, ``x0_hat = z - t v``) in float64 against ``sde_step(method="dance")`` (float32)."""
    from runtime.rl.sampling.scheduler import make_schedule, sde_step

    schedule = make_schedule({"shift": 3.0}, 10)
    g = torch.Generator().manual_seed(5)
    index = torch.tensor([0, 2, 5, 8, 9, 4])
    eta = torch.tensor([0.3, 0.3, 0.7, 1.0, 0.3, 0.0])
    z = torch.randn(SHAPE, generator=g, dtype=torch.float64)
    v = torch.randn(SHAPE, generator=g, dtype=torch.float64)
    noise = torch.randn(SHAPE, generator=g, dtype=torch.float64)

    def reference(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sig = schedule.sigmas.double()
        t, t_next = sig[index].reshape(-1, 1, 1, 1), sig[index + 1].reshape(-1, 1, 1, 1)
        d, e = t_next - t, eta.double().reshape(-1, 1, 1, 1)
        x0_hat = z - t * v
        score = -(z - (1 - t) * x0_hat) / t**2
        mean = z + (v - e**2 / 2 * score) * d
        std = e * (-d).sqrt()
        return mean, std

    mean, std = reference(v)
    prev = (mean + std * noise).detach()
    v64 = v.clone().requires_grad_(True)
    ref_mean, ref_std = reference(v64)
    ok = ref_std.reshape(-1) > 0
    dist = torch.distributions.Normal(ref_mean[ok], ref_std[ok].expand_as(ref_mean[ok]))
    ref_lp = dist.log_prob(prev[ok]).mean(dim=(1, 2, 3))
    (ref_grad,) = torch.autograd.grad(ref_lp.sum(), v64)

    v32 = v.float().requires_grad_(True)
    _, lp, ours_mean, std_dev_t, sqrt_dt = sde_step(
        schedule, z.float(), v32, step_index=index, noise_level=eta, method="dance", prev_sample=prev.float()
    )
    (grad,) = torch.autograd.grad(lp.sum(), v32)
    assert torch.allclose(ours_mean.double(), ref_mean.detach(), rtol=1e-5, atol=1e-5)
    assert torch.allclose((std_dev_t * sqrt_dt).double(), ref_std, rtol=1e-6, atol=0)
    assert torch.allclose(lp[ok].double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
    assert lp[~ok].eq(0).all()  # eta 0: the deterministic Euler step
    assert ((grad[ok].double() - ref_grad[ok]).norm() / ref_grad[ok].norm()).item() < 1e-5


def test_dancegrpo_subsamples_steps_and_shares_noise_per_group_whatever_the_layout() -> None:
    from runtime.rl.algorithms.dancegrpo import Settings, initial_noise, train_positions

    s = Settings(group_size=3, timestep_fraction=0.6)
    whole = train_positions(s, 16, 7, 4, 0, 12)
    assert whole.shape == (12, 9)  # floor(0.6 * 15) of the 15 steps before the last
    assert all(len(set(r.tolist())) == 9 and max(r.tolist()) < 15 for r in whole)
    assert len({tuple(r.tolist()) for r in whole}) > 1  # each sample its own subset
    assert torch.equal(train_positions(s, 16, 7, 4, 6, 6), whole[6:])  # replica 1 of 2 draws what one process did
    assert not torch.equal(train_positions(s, 16, 7, 5, 0, 12), whole)  # a new iteration, new steps
    noise = initial_noise(s, 7, 4, 0, 12, (2, 3, 3))
    for q in range(12):
        assert torch.equal(noise[q], noise[3 * (q // 3)])
    assert not torch.equal(noise[0], noise[3])
    assert torch.equal(initial_noise(s, 7, 4, 4, 5, (2, 3, 3)), noise[4:9])
    assert initial_noise(Settings(init_same_noise=False), 7, 4, 0, 12, (2, 3, 3)) is None


def test_dancegrpo_trains_on_flux(tiny_pipelines, tmp_path: Path) -> None:
    """Every step stochastic, one starting noise per group, K = floor(0.67 * 3) = 2 trained steps per sample."""
    section = {"timestep_fraction": 0.67}
    metrics, rollouts = _tiny_run(tiny_pipelines, tmp_path, "dancegrpo", section)
    for res in rollouts:
        assert torch.equal(res.step_indices, torch.arange(4).expand(4, 4))
        first = res.latents[:, 0]
        assert torch.equal(first[0], first[1]) and torch.equal(first[2], first[3])
        assert not torch.equal(first[0], first[2])
        assert not torch.equal(res.final_latents[0], res.final_latents[1])  # the SDE noise differs
    assert metrics[0]["logprob_gap_max"] == 0.0 and metrics[0]["ratio_mean"] == 1.0


def _velocity(x: torch.Tensor, t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The exact flow velocity ``E[eps - x0 | x_t = x]`` of ``x_t = (1 - t) x0 + t eps`` with ``x0 ~ N(m, 1)``,
    ``eps ~ N(0, 1)``: ``((2t - 1) / V) (x - (1 - t) m) - m`` with ``V = (1 - t)^2 + t^2``."""
    var = (1 - t) ** 2 + t**2
    return (2 * t - 1) / var * (x - (1 - t) * m) - m


def _one_d_run(name: str, settings, iterations: int, reward_sign: float) -> float:
    """``iterations`` RL iterations of algorithm ``name`` on the 1-D Gaussian flow with reward ``reward_sign * x0``
    through the module's window, noise, subsampling, advantages and objective and the real SDE step; returns the
    mean of the policy's ODE samples after training (the learned ``m``, up to the Euler error)."""
    from runtime.rl.config import algorithm
    from runtime.rl.sampling.scheduler import make_schedule, sde_step

    algo = algorithm(name)  # through the loop's contract, as the job calls it
    n, groups, g = 6, 4, settings.group_size
    b = groups * g
    schedule = make_schedule(None, n)
    m = torch.zeros((), requires_grad=True)
    optimizer = torch.optim.Adam([m], lr=0.05)
    group_ids = torch.arange(b) // g
    for k in range(1, iterations + 1):
        w, (lo, hi) = algo.window(settings, n, k)
        gens = [torch.Generator().manual_seed(10_000 * k + q) for q in range(b)]
        starts = torch.stack([torch.randint(lo, hi + 1, (), generator=gen) for gen in gens])
        x = algo.initial_noise(settings, 0, k, 0, b, (1,))
        if x is None:
            x = torch.stack([torch.randn(1, generator=gen) for gen in gens])
        path, old = [x], []
        with torch.no_grad():
            for i in range(n):
                level = torch.where((starts <= i) & (i < starts + w), settings.noise_level, 0.0)
                t = schedule.sigmas[i]
                x, lp, *_ = sde_step(
                    schedule,
                    x,
                    _velocity(x, t, m),
                    step_index=i,
                    noise_level=level,
                    method=settings.sde_type,
                    generator=gens,
                )
                path.append(x)
                old.append(lp)
        adv = algo.advantages(settings, reward_sign * x[:, 0].double(), group_ids)
        positions = algo.train_positions(settings, w, 0, k, 0, b)
        if positions is None:
            positions = torch.arange(w).expand(b, w)
        optimizer.zero_grad()
        rows = torch.arange(b)
        for j in range(positions.shape[1]):
            index = starts + positions[:, j]
            x_in = torch.stack(path)[index, rows]
            x_out = torch.stack(path)[index + 1, rows]
            old_lp = torch.stack(old)[index, rows]
            t = schedule.sigmas[index].reshape(b, 1)
            _, lp, mean, std_dev_t, sqrt_dt = sde_step(
                schedule,
                x_in,
                _velocity(x_in, t, m),
                step_index=index,
                noise_level=settings.noise_level,
                method=settings.sde_type,
                prev_sample=x_out,
            )
            gaussian = (mean, mean.detach(), std_dev_t, sqrt_dt) if algo.needs_old_mean else None
            loss, _ = algo.step_objective(settings, lp, old_lp, adv, None, gaussian)
            (loss / positions.shape[1]).backward()
        optimizer.step()
    with torch.no_grad():
        x = torch.randn((4000, 1), generator=torch.Generator().manual_seed(1))
        for i in range(n):
            x, *_ = sde_step(schedule, x, _velocity(x, schedule.sigmas[i], m), step_index=i, noise_level=0.0)
    return x.mean().item()


ONE_D = {
    "flowgrpo": {"group_size": 8, "window_size": 2},
    "grpo_guard": {"group_size": 8, "window_size": 2},
    "flowdppo": {"group_size": 8, "window_size": 2},
    "mixgrpo": {"group_size": 8, "window_size": 2, "iters_per_group": 2},
    "dancegrpo": {"group_size": 8, "noise_level": 0.7},
}


@pytest.mark.parametrize("name", list(ONE_D))
def test_one_d_gaussian_flow_moves_to_the_rewarded_side(name: str) -> None:
    """Reward ``+x0`` (``-x0``): after 20 iterations the policy's mean (0.006 at the start: 6 Euler steps of the exact
    flow of ``N(0, 1)``) is above +0.6 (below -0.6), for Flow-GRPO and each algorithm alike. Adam at lr 0.05 moves
    ``m`` by at most ~0.05 an iteration, so 0.6 needs the gradient's sign right on most iterations (measured:
    0.86 to 0.97)."""
    from runtime.rl.config import algorithm_module

    settings = algorithm_module(name).Settings(**ONE_D[name])
    up, down = _one_d_run(name, settings, 20, 1.0), _one_d_run(name, settings, 20, -1.0)
    assert up > 0.6 and down < -0.6, (up, down)


SECTIONS = {
    "grpo_guard": {"group_size": 3, "window_size": 2, "adv_clip_max": 0.5, "inner_epochs": 2, "clip_range": 1e-2},
    # the second inner epoch masks (its divergences are far above 1e-12); clamped advantages do not cancel
    "flowdppo": {
        "group_size": 3,
        "window_size": 2,
        "adv_clip_max": 0.5,
        "inner_epochs": 2,
        "kl_mask_threshold": 1e-12,
    },
    # per-group std: MixGRPO's global-std advantages of these rewards stay inside the clip, sum to exactly 0 and make
    # the ratio-1 loss a mathematical zero (its sign is then float32 rounding, which differs between CPUs)
    "mixgrpo": {"group_size": 3, "window_size": 2, "adv_clip_max": 0.5, "iters_per_group": 1, "advantage": "group"},
    "dancegrpo": {"group_size": 3, "adv_clip_max": 0.5, "timestep_fraction": 0.67},
}


def _algorithm_config(name: str, tiny_pipelines, tmp_path: Path, **sections) -> dict:
    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path, **sections)
    raw["flowgrpo"] = {}
    return for_algorithm(raw, name, **SECTIONS[name])


@pytest.mark.parametrize("name", list(SECTIONS))
def test_resume_is_bitwise_per_algorithm(name: str, tiny_pipelines, tmp_path: Path) -> None:
    """A run resumed from its step-1 checkpoint ends with the metrics and weights of the run that never stopped
    (MixGRPO's window, DanceGRPO's steps and shared noise are functions of the iteration and the data position)."""
    assert_resume_is_bitwise(_algorithm_config(name, tiny_pipelines, tmp_path), tmp_path / "ckpt")


@pytest.mark.dist
@pytest.mark.parametrize("name", list(SECTIONS))
def test_fsdp_two_replicas_equal_one_process_per_algorithm(name: str, tiny_pipelines, tmp_path: Path) -> None:
    """Full fine-tuning, FSDP2 over 2 replicas with one prompt each against one process taking both in the same
    layout (chunks of 3 samples): the loss and every gradient within 1e-5 (test_job_dist's comparison)."""
    from tests.dist_utils import run_distributed
    from tests.rl.common import one_iteration, references
    from tests.rl.test_job_dist import _compare

    raw = _algorithm_config(name, tiny_pipelines, tmp_path, lora={"rank": None}, sampling={"batch_size": 3})
    raw[name]["micro_batch_size"] = 3
    ref, witness = references(one_iteration, raw)
    ranks = run_distributed(one_iteration, 2, {**raw, "data": {**raw["data"], "prompts_per_step": 1}}, timeout=300)
    for got in ranks:
        assert got["metrics"]["logprob_gap_max"] == 0.0
        _compare(got, ref, witness, latents=False)


@pytest.mark.dist
@pytest.mark.parametrize("name", list(SECTIONS))
def test_sp2_equals_one_process_per_algorithm(name: str, tiny_pipelines, tmp_path: Path) -> None:
    """Full fine-tuning under Ulysses SP=2: both SP ranks roll out the single process's samples (final latents within
    1e-5, bitwise between the ranks) and the loss and every gradient are within 1e-5 (test_job_dist's comparison)."""
    from tests.dist_utils import run_distributed
    from tests.rl.common import one_iteration, references
    from tests.rl.test_job_dist import _compare

    raw = _algorithm_config(name, tiny_pipelines, tmp_path, lora={"rank": None})
    ref, witness = references(one_iteration, raw)
    ranks = run_distributed(one_iteration, 2, {**raw, "parallel": {"sp": 2}}, timeout=300)
    assert (ranks[0]["final_latents"] == ranks[1]["final_latents"]).all()
    for got in ranks:
        assert got["metrics"]["logprob_gap_max"] <= 1e-6, got["metrics"]["logprob_gap_max"]
        _compare(got, ref, witness)
