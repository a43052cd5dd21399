"""One FlowGRPO iteration (rollout, rewards, training update) of ``runtime.rl``'s job on a random Wan pipeline
generating images (one frame): images/s and the job's own phase split.

``real``: Wan2.1-1.3B's transformer (30 layers, 12 heads of 128) with random weights, 480x832 images, 10 denoising
steps, true CFG, 2 prompts x 4 samples, a 2-step SDE window, LoRA rank 32, bf16, timed after a warm-up
iteration; ``tiny``: 2 layers, 32x32, 2 steps, 2 x 2 samples, a 1-step window, fp32, one iteration (no warm-up).
The text encoder and VAE are the tiny random ones (``WanConditionModel.tiny_components``: 4 latent channels, which
only the patch embedding sees); their cost is not what is measured. The RL package is imported
here only, lazily: it is where the job's public entry lives (``runtime.rl.config`` + ``runtime.rl.run_state``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.gpu_check.common import Context
from bench.gpu_check.measure_dit import WAN_1_3B, WAN_TINY

SAMPLING = {
    "real": {"height": 480, "width": 832, "frames": 1, "num_inference_steps": 10, "true_cfg_scale": 4.0},
    "tiny": {"height": 32, "width": 32, "frames": 1, "num_inference_steps": 2, "true_cfg_scale": 2.0},
}
PROMPTS = 2
GROUP = {"real": 4, "tiny": 2}


def save_pipeline(directory: Path, ctx: Context) -> Path:
    """A Wan pipeline with a random transformer of the step's size and the tiny encoders/VAE that fit it (the
    1.3B transformer initialised on the GPU: seconds, not a minute of CPU)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from runtime.diffusion.conditions.wan import WanConditionModel

    config = {**(WAN_1_3B if ctx.size == "real" else WAN_TINY), "in_channels": 4, "out_channels": 4}
    torch.manual_seed(0)
    components = WanConditionModel.tiny_components(config, None)
    with torch.device(ctx.device):
        transformer = WanTransformer3DModel(**config)
    if ctx.size == "real":
        transformer = transformer.to(torch.bfloat16)  # half the bytes to write and read back
    WanPipeline(**components, transformer=transformer).save_pretrained(directory)
    return directory


def raw_config(pipeline: Path, work: Path, ctx: Context) -> dict[str, Any]:
    prompts = work / "prompts.txt"
    prompts.write_text("a red cube on a table\na cat in the snow\n")
    return {
        "algorithm": "flowgrpo",
        "model": {"type": "wan", "path": str(pipeline), "seed": 0},
        "lora": {"rank": 32 if ctx.cuda else 4, "alpha": 32 if ctx.cuda else 4},
        "data": {"prompts": str(prompts), "prompts_per_step": PROMPTS, "negative_prompt": "blurry"},
        "sampling": SAMPLING[ctx.size],
        "rewards": [{"callable": "tests.rl.rewards:brightness"}],
        "flowgrpo": {"group_size": GROUP[ctx.size], "window_size": 2 if ctx.cuda else 1},
        "optim": {"lr": 1e-4},
        "train": {
            "steps": 2 if ctx.cuda else 1,
            "mixed_precision": "bf16" if ctx.cuda else "fp32",
            "self_check": {"enabled": False, "reason": "not what is timed"},  # tests/rl run the proof
        },
        "log": {"dir": str(work / "log"), "progress": False},
    }


def run(ctx: Context) -> dict[str, Any]:
    from runtime.rl.config import parse_rl_config
    from runtime.rl.loop import iteration
    from runtime.rl.run_state import start_run

    with tempfile.TemporaryDirectory(prefix="gpu-check-rl-") as scratch:
        work = Path(scratch)
        pipeline = save_pipeline(work / "pipeline", ctx)
        run_, _, _ = start_run(parse_rl_config(raw_config(pipeline, work, ctx)))
        if ctx.cuda:
            iteration(run_, 1)  # warm-up: first kernels, the optimizer's state
        ctx.sync()
        start = time.perf_counter()
        metrics, _ = iteration(run_, 2 if ctx.cuda else 1)
        ctx.sync()
        seconds = time.perf_counter() - start
    images = PROMPTS * GROUP[ctx.size]
    phases = {k: v for k, v in metrics.items() if k.startswith(("time_", "cpu_time_"))}
    return {
        "sampling": SAMPLING[ctx.size],
        "images": images,
        "seconds": seconds,
        "images_per_s": images / seconds,
        "phases": phases,
        "summary": f"{images / seconds:.2f} images/s ({images} images, {SAMPLING[ctx.size]['num_inference_steps']} "
        f"steps, {SAMPLING[ctx.size]['height']}x{SAMPLING[ctx.size]['width']}), {seconds:.1f} s/iteration",
    }
