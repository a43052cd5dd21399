"""Tiny RL runs for the tests: real pipeline directories (``save_tiny_pipeline``), a prompts file, a config builder
and the helpers that run a configuration in this process or on a gloo rank (module-level: spawn pickles them)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest

MODELS = ("wan", "flux", "qwenimage", "sd3", "hunyuanvideo")
ACCEPTANCE = ("wan", "flux", "qwenimage", "sd3")  # the acceptance models (every test); HunyuanVideo: most
PROMPTS = ["a red kite", "a blue boat on a lake", "a green hill", "a small dog", "an old tree", "a yellow car"]
# true CFG where the model's pipeline uses it (Wan, Qwen-Image: negative prompt), Flux's guidance embedding
SAMPLING = {
    "wan": {"height": 32, "width": 32, "frames": 5, "num_inference_steps": 4, "true_cfg_scale": 2.0},
    "flux": {"height": 32, "width": 48, "num_inference_steps": 4},
    "qwenimage": {"height": 32, "width": 48, "num_inference_steps": 4, "true_cfg_scale": 2.0},
    "sd3": {"height": 32, "width": 48, "num_inference_steps": 4, "true_cfg_scale": 2.0},
    "hunyuanvideo": {"height": 32, "width": 32, "frames": 5, "num_inference_steps": 4, "true_cfg_scale": 2.0},
    # tests/rl/test_new_dits.py: Sana's tiny DC-AE makes 32x32 pixels an 8x8 latent grid (4 + 4 rows at sp=2)
    "sana": {"height": 32, "width": 32, "num_inference_steps": 4, "true_cfg_scale": 2.0},
    # Lumina2: 4x6 latents -> 2x3 image tokens after each sample's caption tokens (the joint sequence SP splits)
    "lumina2": {"height": 32, "width": 48, "num_inference_steps": 4, "true_cfg_scale": 2.0},
    # LTX-Video: 17 frames of 32x96 -> 3 latent frames of 1x3 = 9 packed tokens (sp=2 pads)
    "ltx_video": {"height": 32, "width": 96, "frames": 17, "num_inference_steps": 4, "true_cfg_scale": 2.0},
    # AuraFlow: 6x10 latents -> 3x5 = 15 image tokens after the 8 registers + 256 text tokens (sp=2 pads the image)
    "auraflow": {"height": 48, "width": 80, "num_inference_steps": 4, "true_cfg_scale": 2.0},
}


@pytest.fixture(scope="session")
def tiny_pipelines(tmp_path_factory: pytest.TempPathFactory):
    """tiny case name -> directory of a tiny random diffusers pipeline, built once per session on first use."""
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    root = tmp_path_factory.mktemp("rl_pipelines")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = save_tiny_pipeline(name, root / name)
        return built[name]

    return get


def write_prompts(directory: Path, suffix: str = ".txt", prompts: list[str] = PROMPTS) -> Path:
    path = directory / f"prompts{len(prompts)}{suffix}"
    if suffix == ".txt":
        path.write_text("\n".join(prompts) + "\n")
    else:
        import json

        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def rl_config(model: str, pipeline: Path, work: Path, **sections: Any) -> dict:
    """A complete config of a 2-prompt x 2-sample, 4-step run with a 2-step SDE window; ``sections`` update it."""
    raw = {
        "algorithm": "flowgrpo",
        "model": {"type": model, "path": str(pipeline), "seed": 0},
        "lora": {"rank": 4, "alpha": 4},
        "data": {"prompts": str(write_prompts(work)), "prompts_per_step": 2, "negative_prompt": "blurry"},
        "sampling": copy.deepcopy(SAMPLING[model]),
        "rewards": [{"callable": "tests.rl.rewards:brightness"}],
        "flowgrpo": {"group_size": 2, "window_size": 2, "adv_clip_max": 0.5},
        "optim": {"lr": 1e-3},
        "train": {"steps": 2},
        "log": {"dir": str(work / "log"), "progress": False},
    }
    for name, values in sections.items():
        raw[name] = {**raw[name], **values} if isinstance(raw.get(name), dict) else values
    return raw


def for_algorithm(raw: dict, name: str, **section: Any) -> dict:
    """``raw`` (an ``rl_config``) for ``algorithm: name``: its ``flowgrpo`` section's keys that ``name``'s Settings
    take, moved under ``name``, updated with ``section``."""
    import dataclasses

    from runtime.rl.config import algorithm_module

    known = {f.name for f in dataclasses.fields(algorithm_module(name).Settings)}
    base = {k: v for k, v in raw["flowgrpo"].items() if k in known}
    out = {k: v for k, v in raw.items() if k != "flowgrpo"}
    return {**out, "algorithm": name, name: {**base, **section}}


def start(raw: dict) -> tuple[Any, int]:
    """``start_run`` of ``raw`` in this process: (the run, the step it resumes after)."""
    from runtime.rl.config import parse_rl_config
    from runtime.rl.run_state import start_run

    run, step, _ = start_run(parse_rl_config(raw))
    return run, step


def tiny_run(raw: dict, iterations: int = 2) -> tuple[list[dict], list]:
    """``iterations`` iterations of ``raw`` in this process, checked: the updates moved the policy and every loss,
    gradient norm and reward (online algorithms) is finite. Returns (their metrics, their rollouts)."""
    import math

    import torch

    from runtime.rl.loop import iteration

    run, _ = start(raw)
    before = trainable_state(run.policy)
    metrics, rollouts = zip(*(iteration(run, step) for step in range(1, iterations + 1)), strict=True)
    after = trainable_state(run.policy)
    assert any(not torch.equal(before[k], after[k]) for k in before), "the policy did not move"
    for m in metrics:  # an offline algorithm (dpo) has no reward
        assert all(math.isfinite(m[k]) for k in ("policy_loss", "grad_norm", "reward") if k != "reward" or k in m), m
    return list(metrics), list(rollouts)


def assert_resume_is_bitwise(raw: dict, ckpt: Path) -> None:
    """Two iterations of ``raw`` with a checkpoint after each, then a run resumed from the step-1 checkpoint: its
    iteration 2 has the metrics (but timings) and ends with the weights of the run that never stopped."""
    import torch

    from runtime.rl.config import parse_rl_config
    from runtime.rl.loop import run_rl
    from runtime.rl.metrics import TIMING_KEYS

    raw = {**raw, "train": {**raw["train"], "steps": 2}, "checkpoint": {"dir": str(ckpt), "interval": 1}}
    whole = run_rl(parse_rl_config(raw))
    again = {**raw, "checkpoint": {**raw["checkpoint"], "resume": str(ckpt / "step_000001")}}
    resumed = run_rl(parse_rl_config(again))
    assert resumed.start_step == 1 and len(resumed.metrics) == 1
    strip = [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in (whole.metrics[1], resumed.metrics[0])]
    assert strip[0] == strip[1]
    a, b = trainable_state(whole.policy), trainable_state(resumed.policy)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def record_gradients(run: Any) -> list[dict[str, Any]]:
    """Each optimizer step of ``run`` first records every trainable parameter's full gradient (collective under
    FSDP: every rank steps). Returns the list the records go to."""
    records: list[dict[str, Any]] = []
    step = run.optimizer.step
    named = [(n, p) for n, p in run.policy.module.named_parameters() if p.requires_grad]

    @functools.wraps(step)  # keeps the LR scheduler's mark on optimizer.step (no "overridden" warning)
    def recording_step(*args: Any, **kwargs: Any) -> Any:
        grads = {}
        for name, p in named:
            g = p.grad
            g = g.full_tensor() if hasattr(g, "full_tensor") else g
            grads[name.replace("_fsdp_wrapped_module.", "")] = None if g is None else g.detach().clone()
        records.append(grads)
        return step(*args, **kwargs)

    run.optimizer.step = recording_step
    return records


def trainable_state(policy: Any) -> dict[str, Any]:
    """Every trainable parameter, full (unsharded), on CPU."""
    out = {}
    for name, p in policy.module.named_parameters():
        if p.requires_grad:
            value = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = value.detach().clone().cpu()
    return out


def one_iteration(rank: int, world_size: int, raw: dict) -> dict[str, Any]:
    """Iteration 1 of ``raw`` on this rank: its metrics, the rollout's final latents and rewards' inputs, and the
    gradients of the update (gathered: full tensors on every rank)."""
    import torch

    from runtime.parallel.state import set_parallel_state
    from runtime.rl.loop import iteration

    with torch.random.fork_rng(devices=[]):
        try:
            run, _ = start(raw)
            grads = record_gradients(run)
            metrics, res = iteration(run, 1)
            return {
                "metrics": metrics,
                "grads": grads[0],
                "final_latents": res.final_latents.detach().clone(),
                "log_probs": res.log_probs.clone(),
            }
        finally:
            set_parallel_state(None)


def relative_error(a: Any, b: Any) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def references(iterate: Any, raw: dict) -> tuple[dict, dict]:
    """``iterate(0, 1, raw)`` in this process, and the same on a rank whose kernels sum in other orders
    (``tests.dist_utils.start_reordered``, run alongside): the reference a layout is compared with, and the witness
    of its float32 rounding (``assert_layout_matches``). The runtime computes in float32 by design (its sampler
    steps in float32), so a float64 truth is not to be had here."""
    from tests.tolerance import references as run_with_witness

    (ref,), (witness,) = run_with_witness(iterate, [(0, 1, raw)])
    return ref, witness


def assert_layout_matches(
    got: dict,
    ref: dict,
    witness: dict | list[dict],
    metrics: tuple[str, ...] = ("policy_loss",),
    scale: dict | None = None,
    weak: tuple[tuple[str, str], ...] = (),
) -> None:
    """A layout's iteration (``got``) against one process's (``ref``) under the rounding model
    (``tests.tolerance``, ``ref - witness`` as the noise): every gradient, each of ``metrics`` and the final latents
    (where recorded); ``scale``: a metric's terms' magnitude where they cancel (a loss at ratio 1 is
    -mean(advantages): terms of unit std); ``weak``: ``tests.tolerance.assert_within_rounding``'s."""
    from tests.tolerance import assert_within_rounding

    def pick(result: dict) -> dict:
        picked = {"grads": result["grads"], **{k: result["metrics"][k] for k in metrics}}
        return picked | ({"final_latents": result["final_latents"]} if "final_latents" in ref else {})

    witnesses = [pick(w) for w in ([witness] if isinstance(witness, dict) else witness)]
    assert_within_rounding(pick(got), pick(ref), witnesses, scale=scale, weak=weak)
