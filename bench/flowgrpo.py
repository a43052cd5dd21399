"""FlowGRPO figures of ``runtime.rl``, in one run, on Wan-shaped models:

1. the time split of an iteration: rollout (no grad, every denoising step), reward (decode + a tiny CLIP checkpoint
   + brightness), training (the window steps recomputed with grad, backward, AdamW), each phase's fastest of
   iterations 2..N (the first warms up; the fastest is the least disturbed by other processes, see
   ``runtime.kernels.timing``), read from the job's own ``time_*`` metrics (wall seconds), on the tiny Wan pipeline
   (one process);
2. activation memory per rank of the training side's recomputation (bytes saved for backward by one window step of
   one sample, true CFG on: the batch doubles) at sp=2 vs sp=1, worst rank over gloo ranks, on a Wan-shaped model
   (4 blocks, hidden 288, 8 heads) with 4096 video tokens per sample (target <= 0.6): exact and repeatable on CPU,
   unlike RSS.

Run: `.venv/bin/python bench/flowgrpo.py [--iterations 15]`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from harness import fastest, saved_activation_bytes, worst_rank

from tests.rl.common import rl_config, start

# The Wan config of bench/dit.py (RoPE t/h/w = 12/12/12) with the tiny VAE's 4 latent channels; text_dim sizes the
# tiny text encoder.
WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=8,
    attention_head_dim=36,
    in_channels=4,
    out_channels=4,
    text_dim=64,
    freq_dim=64,
    ffn_dim=768,
    num_layers=4,
    rope_max_seq_len=256,
)
MEMORY_SAMPLING = {"height": 512, "width": 512, "frames": 13, "num_inference_steps": 1, "true_cfg_scale": 2.0}


def save_wan_pipeline(directory: Path, config: dict[str, Any]) -> Path:
    """A Wan pipeline directory with a random transformer of ``config`` and tiny encoders/VAE that fit it."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from runtime.diffusion.conditions.wan import WanConditionModel

    torch.manual_seed(0)
    components = WanConditionModel.tiny_components(config, None)
    WanPipeline(**components, transformer=WanTransformer3DModel(**config)).save_pretrained(directory)
    return directory


def time_split(work: Path, iterations: int) -> dict[str, float]:
    from runtime.diffusion.tiny import save_tiny_pipeline
    from runtime.rl.loop import iteration
    from runtime.rl.rewards.models import save_tiny_clip

    clip = save_tiny_clip(work / "clip")
    raw = rl_config(
        "wan",
        save_tiny_pipeline("wan", work / "wan"),
        work,
        rewards=[{"callable": "tests.rl.rewards:brightness"}, {"clip": str(clip), "weight": 0.1}],
        sampling={"height": 64, "width": 64, "frames": 9, "num_inference_steps": 8, "true_cfg_scale": 2.0},
        flowgrpo={"group_size": 4, "window_size": 2},
        train={"steps": iterations},
    )
    run, _ = start(raw)
    rows = [iteration(run, step)[0] for step in range(1, iterations + 1)][1:]
    return {k: fastest([r[f"time_{k}"] for r in rows]) for k in ("rollout", "reward", "train")}


def _memory_worker(rank: int, world: int, raw: dict) -> int:
    """This rank's bytes saved for backward by the recomputation of one sample's first window step, on the inputs
    of a rollout through the job's own adapter and policy (FSDP2-wrapped, SP hooks live)."""
    import warnings

    from runtime.flowgrpo.rollout import rollout
    from runtime.parallel.state import set_parallel_state
    from runtime.rl.loop import sample_generators

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    torch.set_num_threads(1)
    try:
        run, _ = start(raw)
        adapter, module = run.policy.adapter, run.policy.module
        batch = adapter.encode([run.prompts[0].text], "blurry")
        steps = run.config.sampling.num_inference_steps
        res = rollout(
            adapter,
            module.eval(),
            batch,
            latent_shape=adapter.latent_shape,
            num_inference_steps=steps,
            window_size=1,
            generators=sample_generators(0, 1, 0, 1),
        )
        batch = {**batch, "schedule": res.schedule}

        def loss() -> torch.Tensor:
            log_prob, *_ = adapter.forward_and_sample_previous_step(
                module.train(),
                batch,
                res.latents[:, 0],
                res.step_indices[:, 0],
                prev_sample=res.latents[:, 1],
                noise_level=torch.full((1,), 0.7),
            )
            return log_prob.mean()

        return saved_activation_bytes(loss)
    finally:
        set_parallel_state(None)


def memory_ratio(work: Path) -> tuple[int, int]:
    pipeline = save_wan_pipeline(work / "wan-bench", WAN)
    raw = rl_config(
        "wan",
        pipeline,
        work,
        sampling=MEMORY_SAMPLING,
        flowgrpo={"group_size": 2, "window_size": 1},
        data={"prompts_per_step": 1},
    )
    one = worst_rank(_memory_worker, 1, raw)
    two = worst_rank(_memory_worker, 2, {**raw, "parallel": {"sp": 2}})
    return one, two


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-flowgrpo-") as scratch:
        work = Path(scratch)
        split = time_split(work, args.iterations)
        total = sum(split.values())
        print("FlowGRPO iteration on tiny Wan T2V (64x64, 9 frames, 8 steps, 2 prompts x 4 samples, true CFG), one")
        print(f"process, fastest of iterations 2..{args.iterations} per phase, wall seconds:")
        for phase, seconds in split.items():
            print(f"  {phase:<8} {seconds:7.3f} s  {seconds / total:6.1%}")
        one, two = memory_ratio(work)
        print("training-side recomputation, one window step of one sample, 4096 video tokens, Wan-shaped (4 blocks,")
        print("hidden 288), true CFG; bytes saved for backward per rank (worst rank):")
        mib = f"  sp=1 {one / 2**20:8.1f} MiB   sp=2 {two / 2**20:8.1f} MiB"
        print(f"{mib}   sp=2/sp=1 {two / one:.3f}  (target <= 0.6)")


if __name__ == "__main__":
    main()
