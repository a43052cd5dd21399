"""``runtime.rl`` on the DiTs whose structures the project added after the first five (docs/dit.md, "New DiT
structures"), at Ulysses SP=2 against one process, full fine-tuning so every transformer parameter's gradient is
compared (the same bounds and reasons as ``test_job_dist``):

* Sana (linear self-attention with all-reduced key-value sums, GLUMBConv's halo rows, the row-aligned split);
* Wan2.2 TI2V-5B as released (a ``WanPipeline`` saved with ``expand_timesteps``: one timestep per latent token,
  sharded with the tokens). RL samples from prompts alone, so no first frame conditions the rollout.

A Wan2.2 A14B pipeline (two transformers switched at ``boundary_ratio``) is refused in one line: the rollout would
switch experts, and which one trains is not chosen (``test_two_expert_pipeline_is_refused``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.rl.common import SAMPLING, one_iteration, relative_error, rl_config
from tests.rl.test_job_dist import FULL, GROUPS_OF_3, REL, _compare


def _wan_pipeline(directory: Path, variant: str | None, **pipeline: object) -> Path:
    """A tiny ``WanPipeline`` of the ``wan`` spec's tiny ``variant`` config (TI2V: its T2V save, as released)."""
    import torch
    from diffusers import WanPipeline

    from runtime.diffusion.conditions.wan import WanConditionModel
    from runtime.diffusion.registry import lookup_dit, tiny_config

    config = tiny_config("wan", variant)
    torch.manual_seed(0)
    components = WanConditionModel.tiny_components(config, variant)
    components = {k: v for k, v in components.items() if k in ("tokenizer", "text_encoder", "vae", "scheduler")}
    upstream = lookup_dit("wan").upstream_class()
    components["transformer"] = upstream(**config)
    if "boundary_ratio" in pipeline:
        components["transformer_2"] = upstream(**config)
    WanPipeline(**components, **pipeline).save_pretrained(directory)
    return directory


def _raw(model: str, tiny_pipelines, tmp_path: Path) -> dict:
    if model == "sana":
        return rl_config("sana", tiny_pipelines("sana"), tmp_path, lora=FULL, flowgrpo=GROUPS_OF_3)
    pipeline = _wan_pipeline(tmp_path / "ti2v", "ti2v", expand_timesteps=True)
    return rl_config("wan", pipeline, tmp_path, lora=FULL, flowgrpo=GROUPS_OF_3)


# Sana's gradients: the linear attention all-reduces its kernel sums across the ranks (another summation order) and
# divides by them, and the cross-attention's query gradients are sums over the tokens of terms that largely cancel, so
# float32 rounding after a 4-step rollout reaches 1.1e-5 (attn1.to_q.weight) and 1.3e-5 (attn2.to_q.bias) in two
# measured runs, every other gradient 6.5e-6 or less; 1e-4 keeps a margin of 8x while a split that attends locally
# is off by O(1). The forward and backward alone are held to 1e-5 (tests/dit/test_sp.py, case sana).
GRAD_REL = {"sana": 1e-4, "wan_ti2v": REL}


@pytest.mark.dist
@pytest.mark.parametrize("model", ["sana", "wan_ti2v"])
def test_sp2_equals_one_process(model: str, tiny_pipelines, tmp_path: Path) -> None:
    raw = _raw(model, tiny_pipelines, tmp_path)
    ref = one_iteration(0, 1, raw)
    ranks = run_distributed(one_iteration, 2, {**raw, "parallel": {"sp": 2}}, timeout=300)
    assert (ranks[0]["final_latents"] == ranks[1]["final_latents"]).all()  # the SP ranks hold the same samples
    for got in ranks:
        assert got["metrics"]["logprob_gap_max"] <= 1e-6, got["metrics"]["logprob_gap_max"]
        assert relative_error(got["final_latents"], ref["final_latents"]) <= REL
        _compare(got, ref, GRAD_REL[model])


def test_ti2v_rollout_passes_one_timestep_per_token(tmp_path: Path) -> None:
    """The released TI2V pipeline's rollout feeds the transformer ``(b, tokens)`` timesteps, all equal (no first
    frame), as ``WanPipeline`` with ``expand_timesteps`` does."""
    import torch

    from runtime.diffusion.conditions.wan import WanConditionModel

    condition = WanConditionModel.from_pretrained(_wan_pipeline(tmp_path / "ti2v", "ti2v", expand_timesteps=True))
    shape = condition.sampling_latent_shape(SAMPLING["wan"]["height"], SAMPLING["wan"]["width"], 5)
    latents = torch.randn(2, *shape)
    context = condition.encode_prompts(["a red kite", "a green hill"])
    inputs = condition.transformer_inputs(latents, context, torch.tensor([0.5, 0.25]))
    tokens = shape[1] * (shape[2] // 2) * (shape[3] // 2)
    assert inputs["timestep"].shape == (2, tokens)
    assert torch.equal(inputs["timestep"], torch.tensor([[500.0], [250.0]]).expand(2, tokens))


def test_two_expert_pipeline_is_refused(tmp_path: Path) -> None:
    """Wan2.2 A14B (``transformer_2`` + ``boundary_ratio``): one line naming the key, not a run of one expert over
    every step."""
    from runtime.config.errors import ConfigError
    from tests.rl.common import start

    pipeline = _wan_pipeline(tmp_path / "a14b", None, boundary_ratio=0.875)
    for condition in ({}, {"expert": "transformer"}):
        with pytest.raises(ConfigError) as error:
            start(rl_config("wan", pipeline, tmp_path, dit={"condition": condition}))
        assert "expert" in str(error.value)
