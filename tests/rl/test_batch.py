"""The job's per-sample batch helpers, the built-in latent reward, and the LoRA-disabled reference (what the
removed second trainer's tests checked that the job's tests do not: its rollout, KL, FSDP and learning checks run
on the job itself in test_job.py, test_job_dist.py, test_algorithms.py and test_nonfinite.py)."""

import pytest
import torch
from peft import LoraConfig

from runtime.rl.batch import repeat_batch, select_rows
from runtime.rl.policy import lora_disabled
from runtime.rl.rewards.latent_mean import LatentMeanReward, Reward, check_rewards
from tests.fixtures.tiny_sd3 import tiny_sd3_transformer


def test_latent_mean_reward() -> None:
    x = (
        torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(0))
        + torch.tensor([0.0, 0.5, 1.0])[:, None, None, None]
    )
    r = LatentMeanReward(target=1.0)(x, ["p"] * 3)
    assert r.shape == (3,) and r.dtype == torch.float32
    assert r[0] < r[1] < r[2] <= 0
    torch.testing.assert_close(r, -(x.mean(dim=(1, 2, 3)) - 1.0).abs())
    only = LatentMeanReward(target=0.0, channels=[1])(x, [])
    torch.testing.assert_close(only, -x[:, 1].mean(dim=(1, 2)).abs())
    assert isinstance(LatentMeanReward(), Reward)
    with pytest.raises(ValueError, match="one value per sample"):
        check_rewards(torch.zeros(2), 3)
    with pytest.raises(ValueError, match="non-finite"):
        check_rewards(torch.tensor([0.0, float("nan")]), 2)


def test_repeat_and_select_rows() -> None:
    batch = {"e": torch.arange(2)[:, None].float(), "p": ["a", "b"], "s": "shared"}
    rep = repeat_batch(batch, 3)
    assert rep["e"].reshape(-1).tolist() == [0, 0, 0, 1, 1, 1] and rep["p"] == ["a"] * 3 + ["b"] * 3
    sub = select_rows(rep, [4, 0])
    assert sub["e"].reshape(-1).tolist() == [1, 0] and sub["p"] == ["b", "a"] and sub["s"] == "shared"


def test_lora_disabled_is_the_base_model() -> None:
    """The ``reference: lora_disabled`` KL compares against the module with every LoRA layer off: the LoRA-free
    module's output, bitwise, and not the trained one's."""
    torch.manual_seed(0)
    module = tiny_sd3_transformer()
    torch.manual_seed(0)
    base = tiny_sd3_transformer()
    module.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["proj_out", "to_q", "to_k", "to_v"]))
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.fill_(0.1)  # a trained LoRA: the policy differs from its base
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 8, 8, generator=g)
    kw = {
        "encoder_hidden_states": torch.randn(2, 5, 12, generator=g),
        "pooled_projections": torch.randn(2, 6, generator=g),
        "timestep": torch.full((2,), 500.0),
    }
    with torch.no_grad():
        with lora_disabled(module) as ref:
            off = ref(x, **kw).sample
        assert torch.equal(off, base(x, **kw).sample)
        assert not torch.equal(module(x, **kw).sample, off)
