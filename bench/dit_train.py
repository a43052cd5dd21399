"""DiT trainer costs, measured as ratios in one run (Wan2.1 T2V: tiny VAE/UMT5 pipeline, bench-size transformer).

1. training step time with cached conditions vs conditions computed on the fly (decode the MP4, VAE-encode the
   clip, UMT5-encode the caption at every step): both trainer jobs (``build_dit_job``, the real ``train_step``:
   forward, backward, clipping, AdamW) are built in this process and their steps alternate in interleaved rounds on
   the shared clock (``bench/harness.py``: user CPU time with one thread on CPU, synchronised wall time on CUDA);
   the ratio is that of their fastest rounds; tokens/s of the cached step beside it;
2. peak memory per rank of one training step (forward + backward through the real trainer's job: FSDP2, Ulysses
   SP) on a long clip, sp=2 vs sp=1 (target <= 0.6). Measured as the bytes glibc's malloc holds for the process
   (``mallinfo2``: in-use heap + mmapped chunks, with a fixed mmap threshold), sampled after every tensor operation;
   the peak minus the value before the step. This counts everything a rank allocates (activations, gathered
   parameters, gradients, communication buffers), unlike autograd's saved tensors alone.

``--dtype bf16`` runs the steps under bf16 autocast (the trainer keeps fp32 parameters); ``--device cuda`` trains on
this process's GPU.

Run: `.venv/bin/python bench/dit_train.py [--device cpu|cuda] [--dtype fp32|bf16] [--repeats 9]`.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from harness import bench_args, fastest, fastest_ratio, interleaved, setup, throughput, worst_rank

from runtime.plan.peak import MallocPeak  # the measured peak the memory plans are validated against

# A bench-size Wan transformer on the tiny pipeline's VAE (4 latent channels) and UMT5 (d_model 16).
TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=8,
    attention_head_dim=36,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=64,
    ffn_dim=768,
    num_layers=4,
    rope_max_seq_len=256,
)
STEP_CLIP = (33, 128, 128)  # frames, height, width -> 9 x 16 x 16 latents -> 9 x 8 x 8 = 576 tokens
LONG_CLIP = (65, 256, 256)  # -> 17 x 32 x 32 latents -> 17 x 16 x 16 = 4352 tokens


def make_pipeline(root: Path) -> Path:
    from diffusers import WanTransformer3DModel

    from runtime.diffusion.tiny_pipelines import save_tiny_pipeline

    pipe = save_tiny_pipeline("wan", root / "pipe")
    torch.manual_seed(0)
    WanTransformer3DModel(**TRANSFORMER).save_pretrained(pipe / "transformer")
    return pipe


def config(root: Path, pipe: Path, data: Path, clip: tuple[int, int, int], cache: bool, **sections: Any) -> dict:
    raw = {
        "model": {"type": "wan", "path": str(pipe)},
        "data": {"path": str(data), "buckets": [list(clip)], "cache": str(root / "cache") if cache else None},
        "train": {"steps": 6},
        "log": {"dir": str(root / "log"), "progress": False, "interval": 100},
    }
    raw.update(sections)
    return raw


def run(raw: dict) -> Any:
    from runtime.parallel.state import set_parallel_state
    from runtime.train.config import parse_config
    from runtime.train.loop import train

    try:
        return train(parse_config(raw))
    finally:
        set_parallel_state(None)


def trainer_step(raw: dict, bench) -> tuple[Callable[[], None], int, float]:
    """One job of the real trainer, built here: (its next training step, tokens per step, FLOPs per token)."""
    from runtime.parallel.state import set_parallel_state
    from runtime.train.config import parse_config
    from runtime.train.dit import build_dit_job
    from runtime.train.loop import setup_parallel, train_step
    from runtime.train.optim import build_optimizer, build_scheduler
    from runtime.train.preflight import check_inputs

    config = parse_config(raw)
    state = setup_parallel(config)
    if bench.device.type == "cuda":  # one process: the trainer's own default is the CPU
        state = dataclasses.replace(state, device_type="cuda")
        set_parallel_state(state)
    job = build_dit_job(config, state, check_inputs(config, state))
    job.model.train()
    optim = dataclasses.replace(config.optim, warmup_steps=0)
    optimizer = build_optimizer([p for p in job.model.parameters() if p.requires_grad], optim)
    scheduler = build_scheduler(optimizer, optim, 10**6)
    steps = itertools.count(1)
    last: list = []

    def step() -> None:
        with bench.autocast():
            last[:] = [train_step(next(steps), job, optimizer, scheduler, state, config, None)]

    step()  # also tells the tokens per step
    return step, last[0].tokens, job.flops_per_token


# ------------------------------------------------------------------------------------------------------- memory


def _memory_worker(rank: int, world: int, raw: dict, dtype: torch.dtype) -> int:
    from runtime.train.config import parse_config
    from runtime.train.dit import build_dit_job
    from runtime.train.loop import setup_parallel
    from runtime.train.preflight import check_inputs

    config = parse_config(raw)
    state = setup_parallel(config)
    job = build_dit_job(config, state, check_inputs(config, state))
    job.model.train()
    tracker = MallocPeak()
    with tracker, torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        job.forward_backward(1)
    return tracker.peak - tracker.base


def peak_bytes_per_rank(world: int, raw: dict, dtype: torch.dtype = torch.float32) -> int:
    return worst_rank(_memory_worker, world, raw, dtype)


def main() -> None:
    import diffusers
    import transformers

    from runtime.data.dit.synthetic import write_synthetic_clips

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    bench = setup(bench_args(__doc__, repeats=9).parse_args())
    root = Path(tempfile.mkdtemp(prefix="patchgen-bench-dit-train-"))
    pipe = make_pipeline(root)
    clips = write_synthetic_clips(root / "clips", 4, *STEP_CLIP, seed=0)
    cached = config(root, pipe, clips, STEP_CLIP, cache=True)
    run({**cached, "train": {"steps": 1}})  # fills the cache (not timed)
    warm, tokens, flops_per_token = trainer_step(cached, bench)
    cold, _, _ = trainer_step(config(root, pipe, clips, STEP_CLIP, cache=False), bench)
    samples = interleaved({"cached": warm, "on the fly": cold}, bench.repeats, bench.clock)
    cached_s, fly_s = (fastest(samples[k]) for k in ("cached", "on the fly"))
    frames, height, width = STEP_CLIP
    print(f"training step, Wan, {frames} frames {height}x{width} ({tokens} tokens), 1 process; {bench.label}")
    rate = throughput(tokens, cached_s, flops_per_token * tokens, bench.device)
    print(f"  cached conditions {cached_s * 1e3:8.1f} ms/step  {rate}")
    print(f"  on the fly        {fly_s * 1e3:8.1f} ms/step")
    print(f"  ratio on the fly / cached {fastest_ratio(samples['on the fly'], samples['cached']):6.2f}")

    long = write_synthetic_clips(root / "long", 1, *LONG_CLIP, seed=1)
    raw = config(root, pipe, long, LONG_CLIP, cache=True, parallel={"activation_checkpointing": False})
    run({**raw, "train": {"steps": 1}})  # fills the cache for the long clip
    one = peak_bytes_per_rank(1, raw, bench.dtype)
    two = peak_bytes_per_rank(2, {**raw, "parallel": {"sp": 2}}, bench.dtype)
    print(f"peak memory per rank of one training step, Wan, {LONG_CLIP[0]} frames {LONG_CLIP[1]}x{LONG_CLIP[2]} "
          f"(17 x 16 x 16 = 4352 tokens)")  # fmt: skip
    print(f"  sp=1 {one / 2**20:8.1f} MiB\n  sp=2 {two / 2**20:8.1f} MiB\n  ratio {two / one:7.3f}  (target <= 0.6)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
