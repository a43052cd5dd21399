import pytest
import torch

from runtime.rl.adapters.registry import get_diffusion_model_cls
from runtime.rl.adapters.sd3 import SD3FlowGRPO
from runtime.rl.sampling.rollout import rollout
from runtime.rl.sampling.scheduler import euler_step
from tests.fixtures.tiny_sd3 import TINY_SD3, tiny_sd3_transformer

TINY = {**TINY_SD3, "num_layers": 2}
B, STEPS, WINDOW = 4, 6, 2


@pytest.fixture(scope="module")
def setup():
    adapter = get_diffusion_model_cls("SD3Transformer2DModel")({"shift": 3.0}, guidance_scale=3.0)
    assert isinstance(adapter, SD3FlowGRPO)
    torch.manual_seed(0)
    module = tiny_sd3_transformer(TINY).eval()
    g = torch.Generator().manual_seed(42)
    batch = {
        "prompt_embeds": torch.randn(B, 5, 12, generator=g),
        "pooled_prompt_embeds": torch.randn(B, 6, generator=g),
        "negative_prompt_embeds": torch.randn(B, 5, 12, generator=g),
        "negative_pooled_prompt_embeds": torch.randn(B, 6, generator=g),
    }
    return adapter, module, batch


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def _run(setup, seeds=(0, 1, 2, 3), **kw):
    adapter, module, batch = setup
    return rollout(
        adapter,
        module,
        batch,
        latent_shape=(4, 8, 8),
        num_inference_steps=STEPS,
        window_size=WINDOW,
        generators=_gens(seeds),
        **kw,
    )


def _sub(batch, rows):
    return {k: v[rows] for k, v in batch.items()}


def test_rollout_shapes_and_reproducible(setup):
    res = _run(setup)
    assert res.latents.shape == (B, WINDOW + 1, 4, 8, 8)
    assert res.step_indices.shape == res.timesteps.shape == res.log_probs.shape == (B, WINDOW)
    assert torch.equal(res.timesteps, res.schedule.timesteps[res.step_indices])
    assert torch.isfinite(res.log_probs).all() and torch.all(res.log_probs != 0)
    assert len(set(res.step_indices[:, 0].tolist())) > 1  # windows really differ per sample
    again = _run(setup)
    assert torch.equal(again.latents, res.latents) and torch.equal(again.log_probs, res.log_probs)
    # a sample's trajectory does not depend on the batch it was rolled out in (same seed, other companions)
    adapter, module, batch = setup
    solo = rollout(
        adapter,
        module,
        _sub(batch, [2]),
        latent_shape=(4, 8, 8),
        num_inference_steps=STEPS,
        window_size=WINDOW,
        generators=_gens([2]),
    )
    assert torch.equal(solo.step_indices, res.step_indices[2:3])
    torch.testing.assert_close(solo.latents, res.latents[2:3], rtol=0, atol=1e-5)


def test_steps_outside_window_are_euler(setup):
    adapter, module, batch = setup
    res = _run(setup, window_start_range=(STEPS - WINDOW, STEPS - WINDOW))  # window at the end
    # replay the deterministic prefix: the window's first latent is the Euler ODE trajectory from the same x_0
    gens = _gens(range(B))
    for g in gens:
        torch.randint(0, 1, (), generator=g)
    x = torch.stack([torch.randn(4, 8, 8, generator=g) for g in gens])
    sched = res.schedule
    batch = {**batch, "schedule": sched}
    with torch.no_grad():
        for i in range(STEPS - WINDOW):
            x = euler_step(sched, i, x, adapter.velocity(module, batch, x, i))
    assert torch.equal(x, res.latents[:, 0])


def test_training_recompute_same_layout_is_bitwise(setup):
    adapter, module, batch = setup
    start = 2
    res = _run(setup, window_start_range=(start, start))  # same window for all: the rollout's batch layout
    batch = {**batch, "schedule": res.schedule}
    for j in range(WINDOW):
        lp, _, _, _ = adapter.forward_and_sample_previous_step(
            module,
            batch,
            res.latents[:, j],
            start + j,
            prev_sample=res.latents[:, j + 1],
            noise_level=torch.full((B,), adapter.noise_level),
        )
        assert torch.equal(lp, res.log_probs[:, j]), j
    # the first update's ratio is exactly 1
    assert torch.equal(torch.exp(lp - res.log_probs[:, -1]), torch.ones(B))


@pytest.mark.parametrize("method", ["sde", "cps"])
def test_training_recompute_other_layout_close(setup, method):
    adapter, module, batch = setup
    adapter = SD3FlowGRPO(adapter.scheduler_config, guidance_scale=adapter.guidance_scale, method=method)
    res = _run((adapter, module, batch))
    batch = {**batch, "schedule": res.schedule}
    # training micro-batch: every (sample, window step) pair, shuffled, samples at different steps in one batch
    pairs = [(s, j) for s in range(B) for j in range(WINDOW)]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(7)).tolist()
    for chunk in (order[:3], order[3:]):
        rows = [pairs[k][0] for k in chunk]
        cols = [pairs[k][1] for k in chunk]
        lp, _, _, _ = adapter.forward_and_sample_previous_step(
            module,
            _sub({k: v for k, v in batch.items() if k != "schedule"}, rows) | {"schedule": res.schedule},
            res.latents[rows, cols],
            res.step_indices[rows, cols],
            prev_sample=res.latents[rows, [c + 1 for c in cols]],
            noise_level=torch.full((len(rows),), adapter.noise_level),
        )
        torch.testing.assert_close(lp, res.log_probs[rows, cols], rtol=0, atol=1e-6)
