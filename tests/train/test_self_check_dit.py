"""The start-up self-check of diffusion transformers: every DiT's shrunk transformer passes at sp = 2, a planted
doubled SP gradient is caught naming a parameter, and the shrink keeps a job's branch (Wan image-to-video) through
the spec's tiny variants."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from runtime.diffusion.registry import dit_model_types, lookup_dit, training_class
from runtime.parallel.parallelize import ParallelPlan
from runtime.parallel.state import ParallelState
from runtime.train.self_check import report
from runtime.train.self_check_dit import prove_dit, shrunk_dit_values
from tests.dist_utils import run_distributed
from tests.rl.common import rl_config, start
from tests.supports import require
from tests.train.self_check_defects import DoubledSPGradientDiT, WanShell, dit_check_worker

SD3Shell = training_class("sd3")


@pytest.mark.dist
@pytest.mark.parametrize("model_type", dit_model_types())
def test_every_dit_passes_at_sp2(model_type: str) -> None:
    require(model_type, "sp")
    results = run_distributed(dit_check_worker, 2, model_type, {"sp_size": 2}, {}, timeout=300)
    line, error = results[0]
    assert error == "" and line.startswith("self-check: passed in "), results
    assert (
        "dp_replicate 1 x dp_shard 1 x sp 2" in line
        and f"generated vs upstream {lookup_dit(model_type).upstream_auto}" in line
    )
    assert re.search(r"power: [12] planted defects? detected", line), line  # a local site (and RoPE where sharded)


@pytest.mark.dist
def test_doubled_sp_gradient_of_a_dit_is_caught() -> None:
    results = run_distributed(dit_check_worker, 2, "wan", {"sp_size": 2}, {}, DoubledSPGradientDiT, timeout=300)
    assert results[0] == results[1] and results[0][0] == "", results  # every rank stops, with the same line
    error = results[0][1]
    assert "its gradient differs by 1.00e+00 relative" in error and "tolerance 1e-04" in error, error  # twice: 1
    assert "sp 2" in error and "train.self_check: {enabled: false, reason: ...} skips the check" in error, error


def test_wan_image_to_video_keeps_its_branch() -> None:
    """A Wan I2V job (image_dim set) is proven with the spec's i2v variant merged in: the image cross-attention
    (add_k_proj) is part of the shrunk model, at the tiny variant's sizes."""
    job = {**lookup_dit("wan").tiny, "image_dim": 1280, "added_kv_proj_dim": 5120, "in_channels": 36}
    values = shrunk_dit_values("wan", job, ParallelState())
    variant = lookup_dit("wan").data["tiny_variants"]["i2v"]
    assert {k: values[k] for k in variant} == variant
    config = WanShell.config_class(**job)
    line = report(prove_dit("wan", ParallelPlan(), ParallelState(), config), 0.0, "train.self_check")
    assert line.startswith("self-check: passed in ") and "WanTransformer3DModel" in line, line
    assert "image_dim" not in {
        k for k, v in shrunk_dit_values("wan", lookup_dit("wan").tiny, ParallelState()).items() if v
    }


@pytest.mark.parametrize(("dual", "expected"), [([0, 1, 2], [0]), ([], [])])
def test_a_variant_merges_only_the_branches_the_job_turns_on(dual: list, expected: list) -> None:
    """SD3.5 medium (rms q/k norms and dual-attention layers) is proven with both, as the spec's sd35 variant has
    them; SD3.5 large (rms q/k norms, no dual-attention layer) with the norms only: the variant's other trigger,
    which the job leaves off, is not merged in (it would prove a structure the job does not run)."""
    job = {**lookup_dit("sd3").tiny, "qk_norm": "rms_norm", "dual_attention_layers": dual}
    values = shrunk_dit_values("sd3", job, ParallelState())
    assert values["qk_norm"] == "rms_norm" and list(values.get("dual_attention_layers", [])) == expected
    line = report(prove_dit("sd3", ParallelPlan(), ParallelState(), SD3Shell.config_class(**job)), 0.0, "x")
    assert line.startswith("self-check: passed in "), line


def test_rl_policy_is_proven_before_the_first_iteration(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``runtime.rl``'s start-up proves the policy's DiT (the same proof, the RL config's ``train.self_check``)."""
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    pipeline = save_tiny_pipeline("flux", tmp_path / "flux")
    start(rl_config("flux", pipeline, tmp_path))
    start(rl_config("flux", pipeline, tmp_path, train={"steps": 2, "self_check": {"enabled": False, "reason": "r"}}))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("self-check:")]
    assert len(lines) == 2 and lines[0].startswith("self-check: passed in "), lines
    assert "FluxTransformer2DModel" in lines[0], lines
    assert lines[1] == "self-check: OFF, this run's layout is unproven (train.self_check.reason: r)", lines


def test_a_condition_model_without_example_inputs_is_one_line() -> None:
    """A newcomer's DiT whose condition model has no example-input builder: the proof cannot build its inputs, and
    says so in one line (a ConfigError: exit 2 through the launchers), naming the file to add it to."""
    from runtime.config.errors import ConfigError
    from runtime.diffusion.conditions.example_inputs import example_inputs

    with pytest.raises(ConfigError) as caught:
        example_inputs("newcomer", {}, torch.Generator().manual_seed(0))
    message = str(caught.value)
    assert "\n" not in message and "condition model 'newcomer'" in message, message
    assert "runtime/diffusion/conditions/example_inputs.py" in message and "wan" in message, message
