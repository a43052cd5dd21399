"""``runtime.rl`` on the generated DiTs in one process (Wan T2V with true CFG, Flux with its guidance embedding,
Qwen-Image with true CFG), tiny random pipelines saved to a temp dir:

* the training side's recomputed log-prob of every window step equals the rollout's bitwise, recomputed here
  independently of the loop through the adapter, and the loop's own gap metric is exactly 0; the first ratio is
  exactly 1; each sample has its own SDE window;
* resume from a checkpoint continues bitwise (metrics and trained weights) like the run that never stopped;
* the export loads through the plain pipeline (LoRA through ``load_lora_weights``, full weights as a pipeline
  directory) and computes what the trained policy computes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.rl.metrics import TIMING_KEYS as TIMES
from tests.rl.common import ACCEPTANCE, MODELS, rl_config, start, trainable_state


@pytest.mark.parametrize("model", MODELS)
def test_recomputed_log_probs_are_the_rollouts_bitwise(model, tiny_pipelines, tmp_path: Path) -> None:
    from runtime.rl.batch import repeat_batch
    from runtime.rl.loop import iteration
    from runtime.rl.prompts import PromptSampler

    raw = rl_config(model, tiny_pipelines(model), tmp_path, optim={"lr": 0.0}, flowgrpo={"window_range": [0, 2]})
    run, _ = start(raw)
    metrics, res = iteration(run, 1)
    assert metrics["logprob_gap_max"] == 0.0 and metrics["ratio_mean"] == 1.0 and metrics["clip_fraction"] == 0.0
    # independently: every window step of every sample through the adapter, in the rollout's layout (all samples)
    adapter, module = run.policy.adapter, run.policy.module
    prompts = [run.prompts[i].text for i in next(PromptSampler(len(run.prompts), 2, seed=0))]  # iteration 1's
    batch = {**repeat_batch(adapter.encode(prompts, "blurry"), 2), "schedule": res.schedule}
    assert len(set(res.step_indices[:, 0].tolist())) > 1  # per-sample windows
    with torch.no_grad():
        for j in range(res.step_indices.shape[1]):
            log_prob, *_ = adapter.forward_and_sample_previous_step(
                module.eval(),
                batch,
                res.latents[:, j],
                res.step_indices[:, j],
                prev_sample=res.latents[:, j + 1],
                noise_level=torch.full((4,), 0.7),
            )
            assert torch.equal(log_prob, res.log_probs[:, j]), (j, log_prob, res.log_probs[:, j])
            assert torch.equal(torch.exp(log_prob - res.log_probs[:, j]), torch.ones(4))


@pytest.mark.parametrize("model", ACCEPTANCE)
def test_resume_is_bitwise(model, tiny_pipelines, tmp_path: Path) -> None:
    from runtime.rl.config import parse_rl_config
    from runtime.rl.loop import run_rl

    ckpt = tmp_path / "ckpt"
    raw = rl_config(
        model, tiny_pipelines(model), tmp_path, checkpoint={"dir": str(ckpt), "interval": 1, "save_total_limit": 3}
    )
    whole = run_rl(parse_rl_config(raw))
    again = {**raw, "checkpoint": {**raw["checkpoint"], "resume": str(ckpt / "step_000001")}}
    resumed = run_rl(parse_rl_config(again))
    assert resumed.start_step == 1 and len(resumed.metrics) == 1
    strip = [{k: v for k, v in m.items() if k not in TIMES} for m in (whole.metrics[1], resumed.metrics[0])]
    assert strip[0] == strip[1]
    a, b = trainable_state(whole.policy), trainable_state(resumed.policy)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first = trainable_state(run_rl(parse_rl_config({**raw, "train": {"steps": 1}, "checkpoint": {}})).policy)
    assert any(not torch.equal(first[k], a[k]) for k in a)  # step 2 did change the policy


def _probe(case_model: str, transformer: torch.nn.Module) -> torch.Tensor:
    from runtime.diffusion.registry import lookup_dit, tiny_config
    from tests.fixtures.dit_inputs import example_inputs

    condition_model_type = lookup_dit(case_model).data["condition_model_type"]
    kwargs = example_inputs(condition_model_type, tiny_config(case_model), torch.Generator().manual_seed(5))
    with torch.no_grad():
        return transformer(**kwargs)[0]


def test_lora_export_loads_with_load_lora_weights(tiny_pipelines, tmp_path: Path) -> None:
    from runtime.checkpoint.diffusers_export import pipeline_class
    from runtime.rl.config import parse_rl_config
    from runtime.rl.loop import run_rl

    path = tiny_pipelines("wan")
    raw = rl_config("wan", path, tmp_path, export={"dir": str(tmp_path / "export")}, optim={"lr": 3e-2})
    result = run_rl(parse_rl_config(raw))
    pipe = pipeline_class(path).from_pretrained(path)
    base = _probe("wan", pipe.transformer)
    pipe.load_lora_weights(tmp_path / "export")
    got, expected = _probe("wan", pipe.transformer), _probe("wan", result.policy.module.eval())
    assert torch.equal(got, expected) and not torch.equal(base, expected)


def test_full_export_is_a_pipeline_directory(tiny_pipelines, tmp_path: Path) -> None:
    from diffusers import DiffusionPipeline

    from runtime.rl.config import parse_rl_config
    from runtime.rl.loop import run_rl

    raw = rl_config("flux", tiny_pipelines("flux"), tmp_path, lora={"rank": None}, export={"dir": str(tmp_path / "x")})
    result = run_rl(parse_rl_config(raw))
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "x")
    assert torch.equal(_probe("flux", pipe.transformer), _probe("flux", result.policy.module.eval()))


def test_frozen_copy_reference_and_ema_export(tiny_pipelines, tmp_path: Path) -> None:
    """Full fine-tuning measures its KL against a frozen copy of the starting weights (0 at the first step, > 0 once
    the policy moved), keeps an EMA, and exports the EMA weights."""
    from diffusers import DiffusionPipeline

    from runtime.rl.config import parse_rl_config
    from runtime.rl.loop import run_rl

    raw = rl_config(
        "flux",
        tiny_pipelines("flux"),
        tmp_path,
        lora={"rank": None},
        dit={"ema_decay": 0.5},
        reference="frozen_copy",
        flowgrpo={"group_size": 2, "window_size": 2, "kl_coef": 0.1},
        export={"dir": str(tmp_path / "x")},
    )
    result = run_rl(parse_rl_config(raw))
    assert result.metrics[0]["kl"] == 0.0 and result.metrics[1]["kl"] > 0.0
    reference, ema = result.policy.reference, result.policy.ema
    assert reference is not None and not any(p.requires_grad for p in reference.parameters())
    exported = DiffusionPipeline.from_pretrained(tmp_path / "x").transformer.state_dict()
    for key, value in ema.state_dict().items():
        assert torch.equal(exported[ema.parameter_name(key)], value), key


def test_bf16_mixed_precision_computes_in_bf16_and_stays_near_fp32(tiny_pipelines, tmp_path: Path) -> None:
    """train.mixed_precision: bf16 (one process: autocast) runs the policy's blocks in bf16 while its parameters stay
    fp32, and the first iteration's rewards and loss stay near the fp32 run's (same seeds, same prompts)."""
    from runtime.rl.config import parse_rl_config
    from runtime.rl.loop import run_rl

    runs = {}
    for mode in ("fp32", "bf16"):
        (tmp_path / mode).mkdir()
        raw = rl_config("flux", tiny_pipelines("flux"), tmp_path / mode, train={"steps": 1, "mixed_precision": mode})
        runs[mode] = run_rl(parse_rl_config(raw))
    module = runs["bf16"].policy.module
    assert all(p.dtype == torch.float32 for p in module.parameters())
    seen = []
    linear = next(m for m in module.modules() if isinstance(m, torch.nn.Linear))
    handle = linear.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    _probe("flux", module)
    handle.remove()
    assert seen and seen[0] == torch.bfloat16
    fp32, bf16 = runs["fp32"].metrics[0], runs["bf16"].metrics[0]
    assert abs(bf16["reward"] - fp32["reward"]) <= 0.05 * abs(fp32["reward"]) + 1e-3, (bf16, fp32)
