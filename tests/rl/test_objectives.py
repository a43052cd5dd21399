import math

import pytest
import torch

from runtime.rl.algorithms.objectives import group_advantages, kl_to_reference, policy_loss


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0, 10.0, 0.0])
    groups = torch.tensor([7, 7, 2, 2, 5, 5])
    adv = group_advantages(rewards, groups, "group", eps=0.0 + 1e-4, ddof=0)  # flow_grpo's population std
    # group 7: mean 2, std 1; group 2: std 0 -> 0; group 5: mean 5, std 5
    expected = torch.tensor([-1 / (1 + 1e-4), 1 / (1 + 1e-4), 0.0, 0.0, 5 / (5 + 1e-4), -5 / (5 + 1e-4)])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)

    glob = group_advantages(rewards, groups, "global", ddof=0)
    std_all = torch.tensor(rewards.tolist(), dtype=torch.float64).std(unbiased=False).item()
    torch.testing.assert_close(glob, torch.tensor([-1, 1, 0, 0, 5, -5.0]) / (std_all + 1e-4), rtol=0, atol=1e-7)

    none = group_advantages(rewards, groups, "none")
    assert torch.equal(none, torch.tensor([-1, 1, 0, 0, 5, -5.0]))
    with pytest.raises(ValueError, match="unknown advantage mode"):
        group_advantages(rewards, groups, "bogus")


def test_policy_loss_hand_computed():
    logp_old = torch.tensor([0.0, 0.0, 0.0, 0.0])
    logp = torch.tensor([math.log(1.5), math.log(0.5), math.log(1.1), 0.0], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0, 9.0])
    loss, clip_frac, approx_kl = policy_loss(logp, logp_old, adv, clip_range=0.2, adv_clip_max=5.0)
    # row0 A=1 ratio 1.5 -> max(-1.5, -1.2) = -1.2; row1 A=1 ratio .5 -> max(-.5, -.8) = -.5
    # row2 A=-1 ratio 1.1 -> max(1.1, 1.1) = 1.1; row3 A clipped to 5, ratio 1 -> -5
    torch.testing.assert_close(loss, torch.tensor((-1.2 - 0.5 + 1.1 - 5.0) / 4))
    torch.testing.assert_close(clip_frac, torch.tensor(0.5))
    d = torch.tensor([math.log(1.5), math.log(0.5), math.log(1.1), 0.0])
    torch.testing.assert_close(approx_kl, 0.5 * (d**2).mean())
    loss.backward()
    # clipped rows have no gradient; unclipped rows get -A * ratio / B
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -0.5 / 4, 1.1 / 4, -5.0 / 4]))


def test_first_update_ratio_is_one():
    logp = torch.randn(8, generator=torch.Generator().manual_seed(0)).requires_grad_()
    adv = torch.randn(8, generator=torch.Generator().manual_seed(1))
    loss, clip_frac, approx_kl = policy_loss(logp, logp.detach().clone(), adv, clip_range=1e-4)
    assert torch.equal(torch.exp(logp - logp.detach()), torch.ones(8))
    assert clip_frac.item() == 0 and approx_kl.item() == 0
    assert torch.equal(loss, -torch.clamp(adv, -5, 5).mean())
    loss.backward()
    assert torch.equal(logp.grad, -torch.clamp(adv, -5, 5) / 8)


def test_kl_to_reference():
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 4, 5, generator=g)
    std_dev_t = torch.tensor([0.5, 0.0, 2.0]).reshape(3, 1, 1)
    sqrt_dt = torch.full((3, 1, 1), 0.25)
    assert kl_to_reference(mean, mean.clone(), std_dev_t, sqrt_dt, "exact").item() == 0
    ref = torch.randn(3, 4, 5, generator=g)
    kl = kl_to_reference(mean, ref, std_dev_t, sqrt_dt, "exact")
    s = (std_dev_t * sqrt_dt).reshape(3)
    per_row = ((mean - ref) ** 2).mean(dim=(1, 2)) / (2 * s**2)
    torch.testing.assert_close(kl, (per_row[0] + per_row[2]) / 3)  # the deterministic row counts 0
    # equals the average element-wise KL of torch.distributions between the two Gaussians
    p = torch.distributions.Normal(mean[[0, 2]], s[[0, 2]].reshape(2, 1, 1).expand(2, 4, 5))
    q = torch.distributions.Normal(ref[[0, 2]], s[[0, 2]].reshape(2, 1, 1).expand(2, 4, 5))
    torch.testing.assert_close(torch.distributions.kl_divergence(p, q).mean(dim=(1, 2)), per_row[[0, 2]])
