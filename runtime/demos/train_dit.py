"""The DiT-trainer demo, on real files end to end:

1. tiny Wan2.1 T2V at sp=2 (2 CPU processes) on a handful of generated clips (MP4 files and frame folders), the
   conditions cached on first use; the run restarted from its mid-run checkpoint reproduces the rest bitwise; a plain
   diffusers ``WanPipeline`` loads the exported pipeline directory and writes a short MP4;
2. tiny Flux.1 LoRA on 2 processes (FSDP) on generated images; a plain ``FluxPipeline`` loads the LoRA file with
   ``load_lora_weights`` and writes a PNG;
3. tiny HunyuanVideo LoRA at sp=2 (joint attention over [video, text], the text refined before the split, the
   layout its spec states and the first SP forward checks); a plain ``HunyuanVideoPipeline`` loads the LoRA file.

Run through `make demo` (runtime/demo.py), or alone: `python -m runtime.demos.train_dit`.
"""

from __future__ import annotations

import functools
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from runtime.demos.train_text import losses, torchrun

WAN_STEPS, WAN_SAVE, FLUX_STEPS, HUNYUAN_STEPS = 30, 15, 20, 24


@functools.cache
def outputs() -> Path:
    """A new folder per demo run for the video and image it writes (kept; never an existing file overwritten)."""
    return Path(tempfile.mkdtemp(prefix="patchgen-demo-outputs-"))


def _config(work: Path, name: str, raw: dict) -> Path:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _falling(curve: dict[int, float], window: int = 5) -> tuple[float, float, bool]:
    steps = sorted(curve)
    first = statistics.mean(curve[s] for s in steps[:window])
    last = statistics.mean(curve[s] for s in steps[-window:])
    return first, last, last < 0.8 * first


def wan(work: Path) -> bool:
    import diffusers

    from runtime.data.dit.synthetic import write_synthetic_clips, write_video
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    pipe_dir = save_tiny_pipeline("wan", work / "wan")
    data = write_synthetic_clips(work / "clips", 8, 9, 32, 32, seed=0, frame_folders_every=4)
    raw = {
        "model": {"type": "wan", "path": str(pipe_dir), "seed": 0},
        "data": {"path": str(data), "buckets": [[9, 32, 32]], "batch_size": 2, "cache": str(work / "cache")},
        "parallel": {"sp": 2},
        "optim": {"lr": 3e-3, "warmup_steps": 3, "min_lr_ratio": 0.1},
        "train": {"steps": WAN_STEPS},
        "checkpoint": {"dir": str(work / "ckpt"), "interval": WAN_SAVE},
        "log": {"dir": str(work / "run"), "progress": False, "interval": 10},
        "export": {"dir": str(work / "wan-export"), "overwrite": True},
    }
    print(f"-- 8 generated clips (9 frames, 32x32: 6 MP4 files, 2 frame folders); {WAN_STEPS} steps, torchrun 2 "
          f"processes, sp=2, checkpoint every {WAN_SAVE}", flush=True)  # fmt: skip
    torchrun(_config(work, "wan", raw))
    straight = losses(work / "run")
    shutil.rmtree(work / "ckpt" / f"step_{WAN_STEPS:06d}")
    print(f"-- restarting from the step-{WAN_SAVE} checkpoint", flush=True)
    torchrun(_config(work, "wan-resumed", {**raw, "log": {**raw["log"], "dir": str(work / "resumed")}}))
    resumed = losses(work / "resumed")
    same = len(resumed) == WAN_STEPS - WAN_SAVE and all(resumed[s] == straight[s] for s in resumed)
    first, last, falling = _falling(straight)

    pipe = diffusers.WanPipeline.from_pretrained(work / "wan-export")
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(
        prompt="a red square moving left on a grey background",
        height=32,
        width=32,
        num_frames=9,
        num_inference_steps=4,
        guidance_scale=1.0,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).frames[0]
    video = write_video(outputs() / "wan_t2v.mp4", [(f * 255).round().astype("uint8") for f in frames])
    print(f"wan loss mean of steps 1-5 -> {WAN_STEPS - 4}-{WAN_STEPS}: {first:.4f} -> {last:.4f} "
          f"({'falling' if falling else 'NOT falling'})")  # fmt: skip
    print(f"resumed steps {WAN_SAVE + 1}-{WAN_STEPS} bitwise equal to the uninterrupted run: {same}")
    print(f"plain diffusers WanPipeline loads the export and writes {video} ({video.stat().st_size} bytes)")
    return same and falling and video.stat().st_size > 0


def flux(work: Path) -> bool:
    import diffusers

    from runtime.data.dit.synthetic import write_synthetic_images
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    pipe_dir = save_tiny_pipeline("flux", work / "flux")
    data = write_synthetic_images(work / "images", 8, 32, 48, seed=1)
    raw = {
        "model": {"type": "flux", "path": str(pipe_dir), "seed": 0},
        "data": {"path": str(data), "buckets": [[32, 48]], "batch_size": 2, "cache": str(work / "flux-cache")},
        "lora": {"rank": 8, "alpha": 16, "target_modules": ["to_q", "to_k", "to_v", "to_out.0", "proj_mlp"]},
        "optim": {"lr": 2e-2, "warmup_steps": 2, "min_lr_ratio": 0.1},
        "train": {"steps": FLUX_STEPS},
        "log": {"dir": str(work / "flux-run"), "progress": False, "interval": 10},
        "export": {"dir": str(work / "flux-lora")},
    }
    print(f"-- tiny Flux.1 LoRA (rank 8), 8 generated images, {FLUX_STEPS} steps, torchrun 2 processes (FSDP)",
          flush=True)  # fmt: skip
    torchrun(_config(work, "flux", raw))
    first, last, falling = _falling(losses(work / "flux-run"))
    pipe = diffusers.FluxPipeline.from_pretrained(pipe_dir)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(
        work / "flux-lora"
    )  # (diffusers notes that the file has no text-encoder LoRA: none trained)
    loaded = any("lora" in name for name, _ in pipe.transformer.named_parameters())
    image = pipe(
        prompt="a blue square, moving up on a white background",
        height=32,
        width=48,
        num_inference_steps=4,
        generator=torch.Generator().manual_seed(0),
    ).images[0]
    image.save(outputs() / "flux_lora.png")
    print(f"flux LoRA loss mean of steps 1-5 -> {FLUX_STEPS - 4}-{FLUX_STEPS}: {first:.4f} -> {last:.4f} "
          f"({'falling' if falling else 'NOT falling'})")  # fmt: skip
    print(
        f"plain diffusers FluxPipeline.load_lora_weights loads the LoRA: {loaded}; wrote {outputs() / 'flux_lora.png'}"
    )
    return falling and loaded


def hunyuanvideo(work: Path) -> bool:
    import diffusers

    from runtime.data.dit.synthetic import write_synthetic_clips
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    pipe_dir = save_tiny_pipeline("hunyuanvideo", work / "hunyuanvideo")
    data = write_synthetic_clips(work / "hv-clips", 8, 9, 32, 32, seed=2, frame_folders_every=4)
    raw = {
        "model": {"type": "hunyuanvideo", "path": str(pipe_dir), "seed": 0},
        "data": {"path": str(data), "buckets": [[9, 32, 32]], "batch_size": 2, "cache": str(work / "hv-cache")},
        "parallel": {"sp": 2},
        "lora": {"rank": 8, "alpha": 16, "target_modules": ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]},
        "optim": {"lr": 5e-2, "warmup_steps": 2, "min_lr_ratio": 0.1},
        "train": {"steps": HUNYUAN_STEPS},
        "log": {"dir": str(work / "hv-run"), "progress": False, "interval": 8},
        "export": {"dir": str(work / "hv-lora")},
    }
    print(f"-- tiny HunyuanVideo LoRA (rank 8), 8 generated clips, {HUNYUAN_STEPS} steps, torchrun 2 processes, "
          f"sp=2", flush=True)  # fmt: skip
    torchrun(_config(work, "hunyuanvideo", raw))
    first, last, falling = _falling(losses(work / "hv-run"), window=4)
    pipe = diffusers.HunyuanVideoPipeline.from_pretrained(pipe_dir)
    pipe.load_lora_weights(work / "hv-lora")
    loaded = any("lora" in name for name, _ in pipe.transformer.named_parameters())
    print(f"hunyuanvideo LoRA loss mean of steps 1-4 -> {HUNYUAN_STEPS - 3}-{HUNYUAN_STEPS}: {first:.4f} -> "
          f"{last:.4f} ({'falling' if falling else 'NOT falling'})")  # fmt: skip
    print(f"plain diffusers HunyuanVideoPipeline.load_lora_weights loads the LoRA: {loaded}")
    return falling and loaded


def main() -> bool:
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    work = Path(tempfile.mkdtemp(prefix="patchgen-dit-demo-"))
    try:
        ok = wan(work)
        ok = flux(work) and ok
        return hunyuanvideo(work) and ok
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
