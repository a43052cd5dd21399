"""The FlowGRPO demo, end to end with the real command: ``torchrun --nproc-per-node 2 -m runtime.rl`` on a tiny Flux.1
pipeline at sp=2 (both processes roll out the same samples, Ulysses attention splits each image's tokens).

Rewards: a CLIP image-text score loaded from a tiny random CLIP checkpoint saved with transformers (the loading
code a real ``openai/clip-vit-large-patch14`` goes through) and a brightness reward named by import path
(``runtime.demos.flowgrpo:brightness``), which a tiny random model can learn in a few iterations. The run stops
after iteration 3 with a checkpoint and a second launch resumes from it; its LoRA export is loaded by a plain
``FluxPipeline`` (``load_lora_weights``), which renders a PNG. Prints the mean reward of the first and last
iterations and the worst rollout-vs-training log-prob gap.

Then one short run of another algorithm, the one whose difference shows in a few iterations: MixGRPO
(``algorithm: mixgrpo``) at sp=2, one SDE step per rollout whose position slides down the schedule every iteration
(``window_start`` 0, 1, 2, 3: every sample of an iteration on the same step, ODE elsewhere) with the training side
still recomputing the rollout's log-probs exactly.

Run through `make demo` (runtime/demo.py), or alone: `python -m runtime.demos.flowgrpo`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

FIRST, TOTAL = 3, 8  # iterations of the first launch (then a checkpoint), of the whole run
PROMPTS = ["a red kite over a hill", "a small boat on a lake", "an old tree in the snow", "a yellow car at night"]


def brightness(samples: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Mean pixel value of each sample (a reward the tiny random model can move)."""
    return samples.float().flatten(1).mean(dim=1)


def config(work: Path, pipeline: Path, clip: Path, steps: int) -> dict:
    """The demo's run config (a complete, valid ``runtime.rl`` config)."""
    return {
        "algorithm": "flowgrpo",
        "model": {"type": "flux", "path": str(pipeline), "seed": 0},
        "lora": {"rank": 8, "alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]},
        "data": {"prompts": str(work / "prompts.txt"), "prompts_per_step": 2},
        "sampling": {"height": 32, "width": 32, "num_inference_steps": 4},
        "rewards": [
            {"name": "brightness", "callable": "runtime.demos.flowgrpo:brightness", "weight": 1.0},
            {"name": "clip", "clip": str(clip), "weight": 0.01},
        ],
        "flowgrpo": {"group_size": 4, "window_size": 2, "noise_level": 1.0, "clip_range": 0.2},
        "parallel": {"sp": 2},
        "optim": {"lr": 0.1, "min_lr_ratio": 1.0},  # a constant rate: the two launches share one schedule
        "train": {"steps": steps},
        "checkpoint": {"dir": str(work / "checkpoints"), "interval": FIRST},
        "log": {"dir": str(work / "log"), "progress": False},
        "export": {"dir": str(work / "export")},
    }


def launch(path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "runtime.rl", str(path)]
    subprocess.run(command, check=True, env=env)


MIX_ITERATIONS = 4


def mixgrpo_window(work: Path, pipeline: Path, clip: Path) -> bool:
    """The MixGRPO sub-step: ``MIX_ITERATIONS`` iterations, one SDE step sliding by one step each iteration."""
    raw = config(work, pipeline, clip, MIX_ITERATIONS) | {"algorithm": "mixgrpo", "checkpoint": {}, "export": {}}
    raw["mixgrpo"] = {**raw.pop("flowgrpo"), "window_size": 1, "iters_per_group": 1, "window_stride": 1}
    raw["log"] = {**raw["log"], "dir": str(work / "log-mixgrpo")}
    print(f"-- MixGRPO, {MIX_ITERATIONS} iterations at sp=2: one SDE step per rollout, sliding each time", flush=True)
    (work / "mixgrpo.yaml").write_text(yaml.safe_dump(raw))
    launch(work / "mixgrpo.yaml")
    rows = [json.loads(line) for line in (work / "log-mixgrpo" / "metrics.jsonl").read_text().splitlines()]
    starts = [r["window_start"] for r in rows]
    gap = max(r["logprob_gap_max"] for r in rows)
    finite = all(math.isfinite(r["policy_loss"]) and r["grad_norm"] > 0 for r in rows)
    ok = starts == list(range(MIX_ITERATIONS)) and gap <= 1e-6 and finite
    rewards = " ".join(f"{r['reward']:.4f}" for r in rows)
    print(
        f"window_start per iteration {starts} (expected {list(range(MIX_ITERATIONS))}); worst |dlogp| {gap:.1e}; "
        f"losses finite and gradients non-zero: {finite}; rewards {rewards}",
        flush=True,
    )
    return ok


def main() -> bool:
    from runtime.checkpoint.diffusers_export import pipeline_class
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline
    from runtime.rl.rewards.models import save_tiny_clip

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="patchgen-demo-flowgrpo-"))
    try:
        pipeline = save_tiny_pipeline("flux", work / "flux")
        clip = save_tiny_clip(work / "clip")
        (work / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
        print(f"-- {FIRST} iterations, torchrun 2 processes at sp=2, then a checkpoint", flush=True)
        (work / "first.yaml").write_text(yaml.safe_dump(config(work, pipeline, clip, FIRST) | {"export": {}}))
        launch(work / "first.yaml")
        print(f"-- a second launch resumes from step_{FIRST:06d} and runs to {TOTAL}, then exports", flush=True)
        (work / "rest.yaml").write_text(yaml.safe_dump(config(work, pipeline, clip, TOTAL)))
        launch(work / "rest.yaml")
        rows = [json.loads(line) for line in (work / "log" / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step"] for r in rows]
        first = sum(r["reward"] for r in rows[:3]) / 3
        last = sum(r["reward"] for r in rows[-3:]) / 3
        gap = max(r["logprob_gap_max"] for r in rows)

        pipe = pipeline_class(pipeline).from_pretrained(pipeline)
        pipe.set_progress_bar_config(disable=True)
        pipe.load_lora_weights(work / "export")
        image = pipe("a red kite over a hill", height=32, width=32, num_inference_steps=4).images[0]
        out = Path(tempfile.mkdtemp(prefix="patchgen-demo-outputs-")) / "flowgrpo.png"
        image.save(out)
        ok = steps == list(range(1, TOTAL + 1)) and last > first and gap <= 1e-6
        print(
            f"mean reward of the first 3 iterations {first:.4f} -> last 3 {last:.4f} "
            f"({'ROSE' if last > first else 'DID NOT RISE'}); worst rollout-vs-training |dlogp| {gap:.1e}; "
            f"plain FluxPipeline + load_lora_weights rendered {out} ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
        mix_started = time.perf_counter()
        mix_ok = mixgrpo_window(work, pipeline, clip)
        seconds = time.perf_counter() - mix_started
        print(f"MixGRPO sub-step {'OK' if mix_ok else 'FAILED'} ({seconds:.0f} s)", flush=True)
        return ok and mix_ok
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
