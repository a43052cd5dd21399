"""Tiny Flow-GRPO training on CPU: a random tiny SD3 transformer learns the built-in latent-mean reward.

Run: ``python -m runtime.demos.flowgrpo``. Prints one row per iteration (mean reward, loss, clip fraction,
approx KL) and whether the mean reward of the last 3 iterations beats that of the first 3. No weights are
downloaded: the model is built from a tiny config with a fixed seed.
"""

from __future__ import annotations

import time

import torch

from runtime.flowgrpo.registry import get_diffusion_model_cls
from runtime.flowgrpo.rewards import LatentMeanReward
from runtime.flowgrpo.sd3 import TINY_SD3
from runtime.flowgrpo.trainer import FlowGRPOTrainer, GRPOConfig


def main(iterations: int = 15, seed: int = 0) -> bool:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        adapter = get_diffusion_model_cls("SD3Transformer2DModel", "flowgrpo")(
            {"shift": 3.0}, guidance_scale=1.0, noise_level=0.7
        )
        torch.manual_seed(seed)
        module = adapter.build_module(TINY_SD3)
        g = torch.Generator().manual_seed(1)
        batch = {
            "prompt_embeds": torch.randn(2, 5, 12, generator=g),
            "pooled_prompt_embeds": torch.randn(2, 6, generator=g),
        }
        config = GRPOConfig(num_inference_steps=4, window_size=2, group_size=4, lr=1e-2, clip_range=0.2, seed=seed)
        trainer = FlowGRPOTrainer(adapter, module, LatentMeanReward(target=0.5), config, latent_shape=(4, 8, 8))
        start = time.perf_counter()
        print(f"{'iter':>4} {'reward':>9} {'loss':>10} {'clip_frac':>9} {'approx_kl':>10}")
        rewards = []
        for _ in range(iterations):
            m = trainer.train_step(["prompt 0", "prompt 1"], batch)
            rewards.append(m["reward_mean"])
            print(
                f"{m['iteration']:>4} {m['reward_mean']:>9.4f} {m['loss']:>10.3e} {m['clip_fraction']:>9.3f} "
                f"{m['approx_kl']:>10.2e}"
            )
        first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
        rose = last > first
        print(
            f"mean reward first 3 iterations {first:.4f} -> last 3 {last:.4f}: {'ROSE' if rose else 'DID NOT RISE'} "
            f"({time.perf_counter() - start:.1f} s)"
        )
        return rose
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
