"""DiT validation samples (``validation: {prompts, every_steps, num_inference_steps, guidance_scale, seed}``): every
``every_steps`` steps (0: only at the end) and at the last step, each prompt generated from the current weights
through the plain diffusers pipeline, written as ``<log.dir>/samples/step_<n>/<ii>-<prompt>.png`` (image models;
``00-a_red_circle.png``) or ``.mp4`` (video models) and sent to the trackers of ``log.report_to``.

The pipeline is the one ``model.path`` names (``model_index.json``), loaded once by diffusers on rank 0 (kept on the
CPU between validations); before each validation its transformer's weights are replaced by the trained ones: the
full weights gathered from the FSDP shards (``full_state_dict``, as the export gathers them), the LoRA merged into
them (``W + alpha / r * B @ A``), and the EMA weights instead of the raw ones when ``dit.ema_decay`` is set (what the
export writes). So a sample is what the exported pipeline would generate at that step with the same prompt and seed.

Each prompt is generated alone (batch of one) with its own generator seeded with ``validation.seed``, at the size of
the first ``data.buckets`` entry (frames too for video models), ``num_inference_steps`` steps and
``guidance_scale`` (null: the pipeline's default). Rank 0 generates while the other ranks wait at a barrier, so the
run stays in lockstep; the wait must fit the process group's timeout (NCCL's default is 10 minutes).
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["VIDEO_FPS", "ValidationSampler", "sample_path"]

VIDEO_FPS = 16  # frames per second of the MP4 samples


def sample_path(log_dir: Path, step: int, index: int, prompt: str, video: bool) -> Path:
    """Where sample ``index`` (its prompt shortened to a file name) of step ``step`` is written."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", prompt).strip("_")[:40] or "prompt"
    return log_dir / "samples" / f"step_{step}" / f"{index:02d}-{slug}.{'mp4' if video else 'png'}"


def _to_uint8(frames: np.ndarray) -> list[np.ndarray]:
    """A pipeline's ``output_type="np"`` frames in [0, 1] as uint8 images, as diffusers' ``numpy_to_pil`` rounds."""
    from diffusers.image_processor import VaeImageProcessor

    return [np.asarray(image.convert("RGB")) for image in VaeImageProcessor.numpy_to_pil(frames)]


def _write_png(path: Path, pixels: np.ndarray) -> None:
    from PIL import Image

    partial = path.with_name(f".{path.name}.tmp")
    Image.fromarray(pixels).save(partial, format="PNG")
    os.replace(partial, path)


def _write_mp4(path: Path, frames: Sequence[np.ndarray]) -> None:
    from runtime.data.dit.synthetic import write_video  # H.264 through PyAV (its wheel bundles FFmpeg)

    partial = path.with_name(f".{path.stem}.tmp.mp4")
    write_video(partial, frames, fps=VIDEO_FPS)
    os.replace(partial, path)


class ValidationSampler:
    """``after_step`` of a DiT job (``runtime/train/loop.py``): collective on the steps it samples at."""

    def __init__(
        self,
        config: Any,  # RunConfig
        rank: int,
        device: torch.device,
        model: torch.nn.Module,
        ema: Any = None,
        peft_config: Any = None,
        video: bool = False,
    ) -> None:
        self.config, self.rank, self.device = config, rank, device
        self.model, self.ema, self.peft_config, self.video = model, ema, peft_config, video
        self.pipeline = None

    def due(self, step: int) -> bool:
        v = self.config.validation
        if not v.prompts:
            return False
        return step == self.config.train.steps or (v.every_steps > 0 and step % v.every_steps == 0)

    def __call__(self, step: int, logger: Any) -> list[Path]:
        if not self.due(step):
            return []
        weights = self.current_weights()  # collective under FSDP: every rank takes part
        paths: list[Path] = []
        if self.rank == 0:
            paths = self.generate(step, weights)
            for index, path in enumerate(paths):
                logger.log_file(f"validation/{index:02d}", path, step)
            logger.say(f"validation: {len(paths)} sample(s) of step {step} in {paths[0].parent}")
        del weights
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        return paths

    def current_weights(self) -> dict[str, torch.Tensor]:
        """The transformer's weights as the export writes them: full (gathered on rank 0), EMA when kept, LoRA
        merged. Other ranks get an empty dict."""
        from runtime.checkpoint.diffusers_export import full_state_dict
        from runtime.checkpoint.lora_weights import merged_state_dict

        weights = full_state_dict(self.model)
        if self.ema is not None:
            averaged = full_state_dict(self.ema)
            weights.update({self.ema.parameter_name(k): v for k, v in averaged.items()})
        if self.peft_config is not None and self.rank == 0:
            weights = merged_state_dict(weights, self.peft_config.lora_alpha / self.peft_config.r)
        return weights

    def load_pipeline(self) -> Any:
        """The plain diffusers pipeline of ``model.path`` (loaded once, kept on the CPU between validations)."""
        if self.pipeline is None:
            from runtime.checkpoint.diffusers_export import pipeline_class

            path = self.config.model.path
            self.pipeline = pipeline_class(path).from_pretrained(path)
            self.pipeline.set_progress_bar_config(disable=True)
        return self.pipeline

    def call_arguments(self, prompt: str) -> dict[str, Any]:
        """The pipeline call of one prompt: size of the first bucket, steps, guidance, a seeded generator."""
        v, bucket = self.config.validation, self.config.data.buckets[0]
        kwargs: dict[str, Any] = {
            "prompt": prompt,
            "num_inference_steps": v.num_inference_steps,
            "generator": torch.Generator(device=self.device).manual_seed(v.seed),
            "output_type": "np",
        }
        if self.video:
            kwargs.update(num_frames=bucket[0], height=bucket[1], width=bucket[2])
        else:
            kwargs.update(height=bucket[0], width=bucket[1])
        if v.guidance_scale is not None:
            kwargs["guidance_scale"] = v.guidance_scale
        return kwargs

    @torch.no_grad()
    def generate(self, step: int, weights: dict[str, torch.Tensor]) -> list[Path]:
        pipeline = self.load_pipeline()
        pipeline.transformer.load_state_dict(weights, strict=True)
        accepted = inspect.signature(pipeline.__call__).parameters
        log_dir = Path(self.config.log.dir)
        paths = []
        pipeline.to(self.device)
        try:
            for index, prompt in enumerate(self.config.validation.prompts):
                kwargs = {k: v for k, v in self.call_arguments(prompt).items() if k in accepted}
                output = pipeline(**kwargs)
                frames = output.frames[0] if self.video else output.images[0]
                path = sample_path(log_dir, step, index, prompt, self.video)
                path.parent.mkdir(parents=True, exist_ok=True)
                if self.video:
                    _write_mp4(path, _to_uint8(np.asarray(frames)))
                else:
                    _write_png(path, _to_uint8(np.asarray(frames)[None])[0])
                paths.append(path)
        finally:
            pipeline.to("cpu")
        return paths
