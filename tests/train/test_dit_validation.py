"""DiT validation samples (``runtime/train/samples.py``) against plain diffusers pipelines built independently:

* tiny Flux, LoRA + EMA, 4 steps, ``every_steps: 2``: the PNGs of steps 2 and 4 equal, pixel for pixel, what a
  plain ``FluxPipeline`` loaded from the fused (EMA, LoRA merged) export of a 2-step and of the 4-step run generates
  with the same prompt, size, steps and seed; they differ from the untrained pipeline's (the weights were replaced);
  the sample files reach TensorBoard as images;
* the same under FSDP on 2 gloo ranks (rank 0 samples from the gathered shards, rank 1 waits): equal to the plain
  pipeline of the run's own export;
* tiny Wan (video, full fine-tuning), ``every_steps: 0``: one MP4 per prompt at the last step only, which PyAV reads
  back with the first bucket's frame count and size, and whose frames decode to those of a plain ``WanPipeline``
  loaded from the export, put through the same H.264 encoder (lossy: the raw frames differ by its rounding).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.train.dit_common import FLUX_BUCKETS, WAN_BUCKETS, dit_config, train_in_process

PROMPTS = ["a red square moving left", "a blue square on a white background"]


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _flux_files(root: Path) -> dict[str, Path]:
    from runtime.data.dit.synthetic import write_synthetic_images
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    images = write_synthetic_images(root / "images", 4, 32, 48, seed=1)
    return {"flux": save_tiny_pipeline("flux", root / "flux"), "images": images, "root": root}


def _reference(pipeline_cls: type, directory: Path, prompt: str, **kwargs) -> np.ndarray:
    """uint8 pixels of a plain pipeline's output (``[H, W, 3]``, or ``[F, H, W, 3]`` for videos)."""
    pipe = pipeline_cls.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt=prompt, generator=torch.Generator().manual_seed(7), output_type="np", **kwargs)
    pixels = out.frames[0] if hasattr(out, "frames") else out.images[0]
    return (np.asarray(pixels) * 255).round().astype(np.uint8)


def _png(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB"))


def test_flux_samples_equal_the_exported_pipeline_at_each_step(tmp_path: Path) -> None:
    from diffusers import FluxPipeline
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = _flux_files(tmp_path)
    common = dict(
        optim={"lr": 5e-2, "warmup_steps": 0, "min_lr_ratio": 1.0},  # a constant lr: the 2-step run is a prefix
        lora={"rank": 4, "alpha": 8},
        dit={"ema_decay": 0.5},
        validation={"prompts": PROMPTS, "every_steps": 2, "num_inference_steps": 2, "seed": 7},
    )
    runs = {}
    for steps in (4, 2):
        work = tmp_path / f"run{steps}"
        raw = dit_config(
            files,
            "flux",
            work,
            train={"steps": steps},
            export={"dir": str(work / "export"), "fuse_lora": True},
            log={"report_to": ["tensorboard"]},
            **common,
        )
        train_in_process(raw)
        runs[steps] = work
    samples = runs[4] / "log" / "samples"
    assert sorted(p.name for p in samples.iterdir()) == ["step_2", "step_4"]
    height, width = FLUX_BUCKETS[0]
    call = dict(height=height, width=width, num_inference_steps=2)
    for index, prompt in enumerate(PROMPTS):
        untrained = _reference(FluxPipeline, files["flux"], prompt, **call)
        got = {}
        for step, export in ((2, runs[2] / "export"), (4, runs[4] / "export")):
            [path] = (samples / f"step_{step}").glob(f"{index:02d}-*.png")
            got[step] = _png(path)
            assert got[step].shape == (height, width, 3)
            np.testing.assert_array_equal(got[step], _reference(FluxPipeline, export, prompt, **call))
        assert not np.array_equal(got[2], untrained) and not np.array_equal(got[2], got[4])
    events = EventAccumulator(str(runs[4] / "log" / "tb"), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("validation/00")] == [2, 4]
    assert [e.step for e in events.Images("plots/loss")] == [4]


@pytest.mark.dist
def test_fsdp_samples_gather_the_sharded_weights(tmp_path: Path) -> None:
    """FSDP over 2 gloo ranks (LoRA + EMA sharded): rank 0 samples from the gathered weights while rank 1 waits; the
    PNG equals the plain pipeline of the run's own fused export."""
    from diffusers import FluxPipeline

    from tests.dist_utils import run_distributed
    from tests.train.dit_common import dit_worker

    files = _flux_files(tmp_path)
    work = tmp_path / "fsdp"
    raw = dit_config(
        files,
        "flux",
        work,
        train={"steps": 2},
        optim={"lr": 5e-2},
        lora={"rank": 4, "alpha": 8},
        dit={"ema_decay": 0.5},
        validation={"prompts": PROMPTS[:1], "every_steps": 1, "num_inference_steps": 2, "seed": 7},
        export={"dir": str(work / "export"), "fuse_lora": True},
    )
    run_distributed(dit_worker, 2, [raw], timeout=300)
    samples = work / "log" / "samples"
    assert sorted(p.name for p in samples.iterdir()) == ["step_1", "step_2"]
    [path] = (samples / "step_2").glob("00-*.png")
    height, width = FLUX_BUCKETS[0]
    expected = _reference(FluxPipeline, work / "export", PROMPTS[0], height=height, width=width, num_inference_steps=2)
    np.testing.assert_array_equal(_png(path), expected)


def test_wan_video_samples_are_mp4_of_the_bucket_size_at_the_end(tmp_path: Path) -> None:
    from diffusers import WanPipeline

    from runtime.data.dit.synthetic import write_synthetic_clips, write_video
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    files = {
        "wan": save_tiny_pipeline("wan", tmp_path / "wan"),
        "clips": write_synthetic_clips(tmp_path / "clips", 4, 9, 32, 32, seed=0),
        "root": tmp_path,
    }
    work = tmp_path / "run"
    raw = dit_config(
        files,
        "wan",
        work,
        train={"steps": 2},
        validation={"prompts": PROMPTS[:1], "every_steps": 0, "num_inference_steps": 2, "seed": 7},
        export={"dir": str(work / "export")},
    )
    train_in_process(raw)
    samples = work / "log" / "samples"
    assert [p.name for p in samples.iterdir()] == ["step_2"]
    [path] = (samples / "step_2").glob("00-*.mp4")
    frames = _mp4(path)
    num_frames, height, width = WAN_BUCKETS[0]
    assert frames.shape == (num_frames, height, width, 3)
    call = dict(num_frames=num_frames, height=height, width=width, num_inference_steps=2)
    expected = _reference(WanPipeline, work / "export", PROMPTS[0], **call)
    # H.264 (yuv420p) is lossy: the reference frames through the same encoder decode to the sample's frames
    np.testing.assert_array_equal(frames, _mp4(write_video(tmp_path / "reference.mp4", list(expected), fps=16)))
    untrained = _mp4(
        write_video(
            tmp_path / "untrained.mp4", list(_reference(WanPipeline, files["wan"], PROMPTS[0], **call)), fps=16
        )
    )
    assert not np.array_equal(frames, untrained)


def _mp4(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
