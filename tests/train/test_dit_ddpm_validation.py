"""A DDPM noise-prediction DiT through the trainer to a plain pipeline: tiny PixArt-Sigma (learned variance), full
fine-tuning from the latent cache, 2 steps, one validation prompt at the last step and the export. The sample PNG
equals, pixel for pixel, what a plain ``PixArtSigmaPipeline`` loaded from the export generates with the same prompt,
size, steps and seed (its defaults otherwise: CFG 4.5, resolution binning, DPM-Solver++ over the trained betas), and
differs from the untrained pipeline's. (SP=2 against one process, the cache and the LoRA export: the DiT suites of
tests/train/test_dit_models.py, which run every DiT spec.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.train.dit_common import train_in_process
from tests.train.test_dit_validation import _png, _reference

PROMPT = "a red square moving left"
HEIGHT, WIDTH = 32, 48


def test_pixart_sigma_sample_equals_the_exported_pipeline(tmp_path: Path) -> None:
    from diffusers import PixArtSigmaPipeline

    from runtime.data.dit.synthetic import write_synthetic_images
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    pipeline = save_tiny_pipeline("pixart_sigma", tmp_path / "pixart_sigma")
    work = tmp_path / "run"
    raw = {
        "model": {"type": "pixart_sigma", "path": str(pipeline), "seed": 0},
        "data": {
            "path": str(write_synthetic_images(tmp_path / "images", 4, HEIGHT, WIDTH, seed=1)),
            "buckets": [[HEIGHT, WIDTH]],
            "cache": str(tmp_path / "cache"),
        },
        "optim": {"lr": 5e-2, "warmup_steps": 0},
        "train": {"steps": 2},
        "validation": {"prompts": [PROMPT], "every_steps": 0, "num_inference_steps": 2, "seed": 7},
        "export": {"dir": str(work / "export")},
        "log": {"dir": str(work / "log"), "progress": False},
    }
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_in_process(raw)
    finally:
        torch.set_num_threads(n)
    [path] = (work / "log" / "samples" / "step_2").glob("00-*.png")
    got = _png(path)
    assert got.shape == (HEIGHT, WIDTH, 3)
    call = dict(height=HEIGHT, width=WIDTH, num_inference_steps=2)
    np.testing.assert_array_equal(got, _reference(PixArtSigmaPipeline, work / "export", PROMPT, **call))
    assert not np.array_equal(got, _reference(PixArtSigmaPipeline, pipeline, PROMPT, **call))
