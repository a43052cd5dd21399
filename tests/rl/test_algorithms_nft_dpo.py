"""DiffusionNFT's pieces (``runtime/rl/algorithms/diffusionnft.py``) against float64 references written here from the
paper's formulas (arXiv:2509.16117), not from the module: the optimality probability, the forward process, and the
objective with its gradient in ``v_theta`` (the closed form ``2 beta [r (v+ - v) - (1 - r) (v- - v)] / (B * n)``
with ``n`` elements per sample)."""

from __future__ import annotations

import pytest
import torch

from runtime.rl.algorithms import diffusionnft
from runtime.rl.sampling import forward

SHAPE = (6, 3, 4, 5)


def _inputs(dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(5)
    out = {
        "v_theta": torch.randn(SHAPE, generator=g, dtype=torch.float64),
        "v_old": torch.randn(SHAPE, generator=g, dtype=torch.float64),
        "target": torch.randn(SHAPE, generator=g, dtype=torch.float64),
        "r": torch.tensor([0.0, 1.0, 0.5, 0.2, 0.9, 0.65], dtype=torch.float64),
    }
    return {k: v.to(dtype) for k, v in out.items()}


def _reference_loss(beta: float, v_theta, v_old, target, r) -> float:
    total = 0.0
    for i in range(v_theta.shape[0]):
        plus = (1 - beta) * v_old[i] + beta * v_theta[i]
        minus = (1 + beta) * v_old[i] - beta * v_theta[i]
        n = plus.numel()
        pos = float(((plus - target[i]) ** 2).sum()) / n
        neg = float(((minus - target[i]) ** 2).sum()) / n
        total += float(r[i]) * pos + (1 - float(r[i])) * neg
    return total / v_theta.shape[0]


@pytest.mark.parametrize("beta", [1.0, 0.1, 2.5])
@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_nft_objective_and_gradient_match_the_paper(beta: float, dtype: torch.dtype, rtol: float) -> None:
    x = _inputs(dtype)
    ref64 = {k: v.double() for k, v in x.items()}
    v_theta = x["v_theta"].clone().requires_grad_(True)
    settings = diffusionnft.Settings(beta=beta)
    loss, stats = diffusionnft.objective(settings, v_theta, x["v_old"], x["target"], x["r"])
    loss.backward()
    expected = _reference_loss(beta, **ref64)
    assert float(loss.detach()) == pytest.approx(expected, rel=rtol)
    assert float(stats["policy_loss"]) == pytest.approx(expected, rel=rtol)
    b, n = SHAPE[0], v_theta[0].numel()
    r = ref64["r"].reshape(-1, 1, 1, 1)
    plus = (1 - beta) * ref64["v_old"] + beta * ref64["v_theta"]
    minus = (1 + beta) * ref64["v_old"] - beta * ref64["v_theta"]
    grad = 2 * beta * (r * (plus - ref64["target"]) - (1 - r) * (minus - ref64["target"])) / (b * n)
    torch.testing.assert_close(
        v_theta.grad.double(), grad, rtol=rtol * 10, atol=1e-12 if dtype == torch.float64 else 1e-8
    )


def test_nft_old_velocity_gets_no_gradient_and_r_half_is_plain_flow_matching_around_v_old() -> None:
    """At ``r = 1/2`` the loss is ``||v_old - v||^2 + beta^2 ||v_theta - v_old||^2`` (expanding the two squares): a
    sample neither positive nor negative only pulls ``v_theta`` to ``v_old``; ``v_old`` is a constant."""
    x = _inputs(torch.float64)
    v_old = x["v_old"].clone().requires_grad_(True)
    v_theta = x["v_theta"].clone().requires_grad_(True)
    beta = 0.7
    r = torch.full((SHAPE[0],), 0.5, dtype=torch.float64)
    loss, _ = diffusionnft.objective(diffusionnft.Settings(beta=beta), v_theta, v_old, x["target"], r)
    loss.backward()
    assert v_old.grad is None
    expected = ((x["v_old"] - x["target"]) ** 2).mean() + beta**2 * ((x["v_theta"] - x["v_old"]) ** 2).mean()
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-12)


def test_nft_optimality_probability() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 10.0, 0.0, 5.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    settings = diffusionnft.Settings(reward_norm=2.0)
    got = diffusionnft.optimality(settings, rewards, groups)
    # group means 2, 10, 2.5; r = 1/2 + 1/2 clip(dR / 2, -1, 1)
    expected = [0.25, 0.5, 0.75, 0.5, 0.5, 0.5, 0.0, 1.0]
    assert got.tolist() == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize("unit", ["global", "group"])
def test_nft_optimality_in_reward_stds(unit: str) -> None:
    """``Z_c = reward_norm * std`` (the paper's usual choice of ``Z_c``, verl-omni's global std) written per sample
    with ``statistics`` (sample std, divisor N - 1); a group of equal rewards gets ``r = 1/2``."""
    import statistics

    rewards = [0.3, 1.7, 0.9, 2.0, 2.0, 2.0, -1.0, 4.0, 0.5, 0.25, 3.0, 0.0]
    groups = [i // 3 for i in range(12)]
    settings = diffusionnft.Settings(reward_norm=1.5, reward_std=unit)
    got = diffusionnft.optimality(settings, torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups))
    for i, (reward, group) in enumerate(zip(rewards, groups, strict=True)):
        members = [x for x, g in zip(rewards, groups, strict=True) if g == group]
        std = statistics.stdev(rewards if unit == "global" else members)
        centred = reward - statistics.fmean(members)
        expected = 0.5 if std == 0 else 0.5 + 0.5 * max(-1.0, min(1.0, centred / (1.5 * std)))
        assert float(got[i]) == pytest.approx(expected, rel=1e-12, abs=1e-15), (i, float(got[i]), expected)
    assert any(0.0 < float(v) < 1.0 and float(v) != 0.5 for v in got)  # not only clipped or neutral values


def test_nft_forward_process() -> None:
    g = torch.Generator().manual_seed(3)
    x0, eps = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    t = torch.tensor([0.0, 1.0, 0.25, 0.5, 0.75, 0.1])
    xt, v = forward.noised(x0, eps, t)
    for i, ti in enumerate(t.tolist()):
        torch.testing.assert_close(xt[i], (1 - ti) * x0[i] + ti * eps[i])
    torch.testing.assert_close(v, eps - x0)


def _gaussian_velocity(m: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The exact velocity of the path ``x_t = (1 - t) x0 + t eps``, ``x0 ~ N(m, 1)``, ``eps ~ N(0, 1)``:
    ``E[eps - x0 | x_t] = (2t - 1) (x_t - (1 - t) m) / ((1 - t)^2 + t^2) - m`` (Gaussian conditioning)."""
    s2 = (1 - t) ** 2 + t**2
    return (2 * t - 1) * (x - (1 - t) * m) / s2 - m


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_nft_moves_a_1d_gaussian_flow_towards_the_reward(sign: float) -> None:
    """A 1-D flow whose policy is ``x0 ~ N(m, 1)`` with its exact velocity; the reward ``sign * x0``. Each iteration
    samples groups from the current policy, turns rewards into ``r`` and takes Adam steps on the NFT objective at
    random ``t``: the mean moves past ``+-0.6`` in 20 iterations, in the reward's direction (and only through the
    objective: the reference above checks its value and gradient)."""
    g = torch.Generator().manual_seed(0)
    m = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([m], lr=0.05)
    settings = diffusionnft.Settings(beta=1.0, reward_norm=1.0)
    groups, size = 8, 8
    group_ids = torch.arange(groups * size) // size
    for _ in range(20):
        m_old = m.detach().clone()
        x0 = m_old + torch.randn(groups * size, generator=g, dtype=torch.float64)
        r = diffusionnft.optimality(settings, sign * x0, group_ids)
        for _ in range(4):
            eps = torch.randn(groups * size, generator=g, dtype=torch.float64)
            t = torch.rand(groups * size, generator=g, dtype=torch.float64).clamp(0.02, 0.98)
            xt, target = forward.noised(x0, eps, t)
            loss, _ = diffusionnft.objective(
                settings,
                _gaussian_velocity(m, xt, t)[:, None],
                _gaussian_velocity(m_old, xt, t)[:, None],
                target[:, None],
                r,
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert sign * float(m.detach()) > 0.6, float(m.detach())


@pytest.mark.parametrize("beta", [1.0, 50.0, 5000.0])
def test_dpo_objective_gradient_and_accuracy_match_the_paper(beta: float) -> None:
    """Diffusion-DPO's loss ``-log sigmoid(-beta/2 * ((e_w - e_w_ref) - (e_l - e_l_ref)))`` in float64 written with
    ``math`` per pair, and its gradient in ``v_w``: ``sigmoid(beta/2 * d) * beta/2 * 2 (v_w - v^w) / (n B)``."""
    import math

    from runtime.rl.algorithms import dpo

    g = torch.Generator().manual_seed(9)
    shape = (5, 2, 3, 3)
    v_w, v_l, v_w_ref, v_l_ref, t_w, t_l = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(6))
    v_w_ref = v_w + 0.01 * v_w_ref  # near the policy: margins where the sigmoid is not saturated at small beta
    v_l_ref = v_l + 0.01 * v_l_ref
    vw = v_w.clone().requires_grad_(True)
    loss, stats = dpo.objective(dpo.Settings(beta=beta), vw, v_l, v_w_ref, v_l_ref, t_w, t_l)
    loss.backward()
    b, n = shape[0], v_w[0].numel()
    total, correct, grad = 0.0, 0, torch.empty_like(v_w)
    for i in range(b):
        e = [
            float(((a[i] - c[i]) ** 2).sum()) / n for a, c in ((v_w, t_w), (v_w_ref, t_w), (v_l, t_l), (v_l_ref, t_l))
        ]
        d = (e[0] - e[1]) - (e[2] - e[3])
        z = -beta / 2 * d
        total += math.log1p(math.exp(-z)) if z > -30 else -z  # -log sigmoid(z)
        correct += d < 0
        grad[i] = (1 / (1 + math.exp(z))) * (beta / 2) * 2 * (v_w[i] - t_w[i]) / (n * b)
    assert float(loss.detach()) == pytest.approx(total / b, rel=1e-10)
    assert float(stats["implicit_reward_accuracy"]) == correct / b
    torch.testing.assert_close(vw.grad, grad, rtol=1e-9, atol=1e-15)


def test_dpo_prefers_the_chosen_image_after_training() -> None:
    """A free velocity per pair trained on the DPO loss from the reference: its error falls on the chosen images
    and rises on the rejected ones relative to the reference, and the reward accuracy reaches 1."""
    from runtime.rl.algorithms import dpo

    g = torch.Generator().manual_seed(2)
    shape = (4, 8)
    ref_w, ref_l, t_w, t_l = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4))
    v_w, v_l = ref_w.clone().requires_grad_(True), ref_l.clone().requires_grad_(True)
    opt = torch.optim.SGD([v_w, v_l], lr=0.5)
    settings = dpo.Settings(beta=10.0)
    for _ in range(30):
        loss, stats = dpo.objective(settings, v_w, v_l, ref_w, ref_l, t_w, t_l)
        opt.zero_grad()
        loss.backward()
        opt.step()
    err = lambda v, t: (v.detach() - t).square().mean(dim=1)  # noqa: E731
    assert bool((err(v_w, t_w) < err(ref_w, t_w)).all()) and bool((err(v_l, t_l) > err(ref_l, t_l)).all())
    _, stats = dpo.objective(settings, v_w, v_l, ref_w, ref_l, t_w, t_l)
    assert float(stats["implicit_reward_accuracy"]) == 1.0


def _nft_raw(tiny_pipelines, tmp_path, **section) -> dict:
    from tests.rl.common import for_algorithm, rl_config

    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path)
    return for_algorithm(raw, "diffusionnft", **section)


def test_nft_trains_on_flux(tiny_pipelines, tmp_path) -> None:
    """Two checked iterations (two inner epochs, two forward-process draws per sample) on the tiny Flux pipeline:
    the trainable parameters change, every loss is finite, ``r`` lies in ``[0, 1]``."""
    from tests.rl.common import tiny_run

    metrics, _ = tiny_run(_nft_raw(tiny_pipelines, tmp_path, inner_epochs=2, timesteps_per_sample=2))
    assert all(0.0 <= m["optimality_mean"] <= 1.0 for m in metrics)


def test_nft_resume_is_bitwise(tiny_pipelines, tmp_path) -> None:
    """A run resumed from its step-1 checkpoint ends with the metrics and weights of the run that never stopped (the
    forward-process draws are functions of the iteration and the data position)."""
    from tests.rl.common import assert_resume_is_bitwise

    assert_resume_is_bitwise(_nft_raw(tiny_pipelines, tmp_path), tmp_path / "ckpt")


@pytest.mark.dist
def test_nft_fsdp_two_replicas_equal_one_process(tiny_pipelines, tmp_path) -> None:
    """Full fine-tuning, FSDP2 over 2 replicas with one prompt each against one process taking both in the same
    layout (chunks of 3 samples): the loss and every gradient within test_job_dist's tolerances (the draws of ``t``
    and ``eps`` are per global sample)."""
    from tests.dist_utils import run_distributed
    from tests.rl.common import one_iteration, references
    from tests.rl.test_job_dist import _compare

    raw = _nft_raw(tiny_pipelines, tmp_path, micro_batch_size=3)
    raw["diffusionnft"]["group_size"] = 3  # whole micro-batches: the metrics are means over micro-batches
    raw["lora"], raw["sampling"] = {"rank": None}, {**raw.get("sampling", {}), "batch_size": 3}
    ref, witness = references(one_iteration, raw)
    ranks = run_distributed(one_iteration, 2, {**raw, "data": {**raw["data"], "prompts_per_step": 1}}, timeout=300)
    for got in ranks:
        _compare(got, ref, witness, latents=False)


@pytest.mark.dist
def test_nft_sp2_equals_one_process(tiny_pipelines, tmp_path) -> None:
    """Full fine-tuning under Ulysses SP=2: the loss and every gradient within test_job_dist's tolerances."""
    from tests.dist_utils import run_distributed
    from tests.rl.common import one_iteration, references
    from tests.rl.test_job_dist import _compare

    raw = _nft_raw(tiny_pipelines, tmp_path, group_size=3)
    raw["lora"] = {"rank": None}
    ref, witness = references(one_iteration, raw)
    ranks = run_distributed(one_iteration, 2, {**raw, "parallel": {"sp": 2}}, timeout=300)
    assert (ranks[0]["final_latents"] == ranks[1]["final_latents"]).all()
    for got in ranks:
        _compare(got, ref, witness)


def test_nft_config_errors_name_the_key(tiny_pipelines, tmp_path) -> None:
    """``t_min >= t_max`` and a key of the SDE algorithms (the rollout here is the ODE) are one-line user errors."""
    from runtime.config.errors import ConfigError
    from runtime.rl.config import parse_rl_config

    with pytest.raises(ConfigError, match=r"diffusionnft\.t_max: expected t_min < t_max"):
        parse_rl_config(_nft_raw(tiny_pipelines, tmp_path, t_min=0.5, t_max=0.5))
    with pytest.raises(ConfigError, match=r"diffusionnft\.noise_level"):
        parse_rl_config(_nft_raw(tiny_pipelines, tmp_path, noise_level=0.7))
    with pytest.raises(ConfigError, match=r"diffusionnft\.reward_std: .*global"):
        parse_rl_config(_nft_raw(tiny_pipelines, tmp_path, reward_std="batch"))
    config = parse_rl_config(_nft_raw(tiny_pipelines, tmp_path, beta=0.1, reward_std="group"))
    assert config.algo.beta == 0.1 and config.algo.noise_level == 0.0 and config.algo.reward_std == "group"
