"""Tiny DiT runs for the trainer tests: real pipeline directories, real data files, and a worker that trains
several configurations in one gloo world (module-level so spawn can pickle it)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from tests.train.common import witness_config

WAN_BUCKETS = [[9, 32, 32]]  # 9 frames -> 3 latent frames of 4x4 -> 12 tokens
FLUX_BUCKETS = [[32, 48], [32, 32]]  # 2x3 and 2x2 packed tokens


def make_files(root: Path) -> dict[str, Path]:
    """Tiny Wan T2V and Flux pipelines, 8 clips (MP4 and frame folders) and 8 images of two sizes."""
    from runtime.data.dit.synthetic import write_synthetic_clips, write_synthetic_images
    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    images = write_synthetic_images(root / "images", 4, 32, 48, seed=1)
    square = write_synthetic_images(root / "images" / "square", 4, 40, 40, seed=2)  # media stay inside images/
    lines = images.read_text().splitlines() + [
        line.replace('"images/', '"square/images/') for line in square.read_text().splitlines()
    ]
    images.write_text("\n".join(lines) + "\n")
    return {
        "wan": save_tiny_pipeline("wan", root / "wan"),
        "flux": save_tiny_pipeline("flux", root / "flux"),
        "clips": write_synthetic_clips(root / "clips", 8, 9, 32, 32, seed=0, frame_folders_every=3),
        "images": images,
        "root": root,
    }


def dit_config(files: dict[str, Path], model: str, work: Path, **sections: Any) -> dict:
    wan = model == "wan"
    raw = {
        "model": {"type": model, "path": str(files[model]), "seed": 0},
        "data": {
            "path": str(files["clips" if wan else "images"]),
            "buckets": copy.deepcopy(WAN_BUCKETS if wan else FLUX_BUCKETS),
            "cache": str(files["root"] / f"cache-{model}"),
        },
        "optim": {"lr": 2e-3, "warmup_steps": 1},
        "train": {"steps": 3},
        "log": {"dir": str(work / "log"), "progress": False},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def per_step(result: Any) -> list[tuple[float, float]]:
    return [(m.loss, m.grad_norm) for m in result.metrics]


def steps_of(raw: dict, witness: bool = False) -> list[tuple[float, float]]:
    """The per-step (loss, grad norm) of ``raw`` trained in this process (``witness``: ``witness_config``'s)."""
    return per_step(train_in_process(witness_config(raw) if witness else raw))


def reference_steps(configs: list[dict]) -> tuple[list, list]:
    """Each config trained in this process and, alongside, on kernels that sum in other orders (the witness of the
    rounding model, ``tests.tolerance.references``)."""
    from tests.dist_utils import start_reordered

    pending = start_reordered(witness_steps, configs)
    return [steps_of(raw) for raw in configs], pending()


def witness_steps(rank: int, world_size: int, configs: list[dict]) -> list[list[tuple[float, float]]]:
    return [steps_of(raw, witness=True) for raw in configs]


def train_in_process(raw: dict) -> Any:
    """``runtime.train`` in this process; the global RNG and parallel-state handle are given back afterwards."""
    import torch

    from runtime.parallel.state import set_parallel_state
    from runtime.train.config import parse_config
    from runtime.train.loop import train

    with torch.random.fork_rng(devices=[]):
        try:
            return train(parse_config(raw))
        finally:
            set_parallel_state(None)


def dit_worker(rank: int, world_size: int, cases: list[dict]) -> list[Any]:
    """Train each case in turn on this world; a case with ``"resume_from_step"`` deletes the newer checkpoints
    (rank 0) and trains again with ``resume: auto``. Returns per case the per-step (loss, grad norm)."""
    import shutil

    import torch.distributed as dist

    out = []
    for raw in cases:
        raw = copy.deepcopy(raw)
        again = raw.pop("resume_from_step", None)
        first = per_step(train_in_process(raw))
        if again is None:
            out.append(first)
            continue
        dist.barrier()
        if rank == 0:
            for path in Path(raw["checkpoint"]["dir"]).glob("step_*"):
                if int(path.name.split("_")[1]) > again:
                    shutil.rmtree(path)
        dist.barrier()
        out.append((first, per_step(train_in_process(raw))))
    return out
