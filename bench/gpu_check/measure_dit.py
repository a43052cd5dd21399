"""Wan DiT training step (forward + backward, MSE to a random target): the generated wan shell vs diffusers'
``WanTransformer3DModel`` with the same random weights; latent tokens/s, MFU, and their ratio (<= 1.02x).

``real``: Wan2.1-T2V-1.3B's transformer (30 layers, 12 heads of 128, ffn 8960), bf16, one 480x832 clip of 21
frames (6 x 30 x 52 = 9360 latent tokens, a 480p-class count; ``runtime.plan`` estimates 58 GiB of activations for
33 frames, so about 39 GiB here, which fits an 80 GiB H100 beside both models without checkpointing) with 512 text
tokens. ``tiny``: 2 layers, hidden 96, a 9-frame 64x64 clip (3 x 4 x 4 = 48 tokens), fp32. FLOPs: torch's own
counter over one generated step.
"""

from __future__ import annotations

from typing import Any

import torch

from bench.gpu_check.common import Context, mfu, time_jobs

WAN_1_3B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
WAN_TINY = {**WAN_1_3B, "num_attention_heads": 4, "attention_head_dim": 24, "text_dim": 32, "freq_dim": 32}
WAN_TINY.update(ffn_dim=128, num_layers=2)
CLIP = {"real": dict(frames=21, height=480, width=832, text_tokens=512), "tiny": dict(frames=9, height=64, width=64)}
CONFIGS = {"real": WAN_1_3B, "tiny": WAN_TINY}


def workload(size: str):
    from runtime.plan.config import Workload

    return Workload(**{"text_tokens": 16, **CLIP[size]})


def inputs(ctx: Context, config: Any) -> tuple[dict[str, Any], int]:
    """Random latents and text states of the clip on the device (the timestep stays fp32); (kwargs, tokens)."""
    from runtime.plan.config import PlanModel
    from runtime.plan.dit_inputs import dit_inputs

    shapes, tokens = dit_inputs(PlanModel(type="wan"), config, workload(ctx.size))
    g = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {}
    for key, value in shapes.items():
        if isinstance(value, torch.Tensor):
            dtype = torch.float32 if key == "timestep" else ctx.dtype
            value = value if key == "timestep" else torch.randn(value.shape, generator=g)
            value = value.to(ctx.device, dtype)
        out[key] = value
    return out, tokens


def models(ctx: Context) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(diffusers, generated) with the same weights, on the device in the step's dtype."""
    from runtime.diffusion.registry import lookup_dit, training_class

    config = CONFIGS[ctx.size]
    cls = training_class("wan")
    torch.manual_seed(0)
    with torch.device(ctx.device):
        generated = cls(cls.config_class(**config))
        upstream = lookup_dit("wan").upstream_class()(**config)
    upstream.load_state_dict(generated.state_dict())
    return upstream.to(ctx.dtype).train(), generated.to(ctx.dtype).train()


def step(model: torch.nn.Module, kwargs: dict[str, Any]):
    def run() -> None:
        out = model(**kwargs)[0].float()
        out.square().mean().backward()
        model.zero_grad(set_to_none=True)

    return run


def run(ctx: Context) -> dict[str, Any]:
    from torch.utils.flop_counter import FlopCounterMode

    upstream, generated = models(ctx)
    kwargs, tokens = inputs(ctx, generated.config)
    times = time_jobs(ctx, {"diffusers": step(upstream, kwargs), "generated": step(generated, kwargs)})
    with FlopCounterMode(display=False) as counter:
        step(generated, kwargs)()
    gen = mfu(counter.get_total_flops(), times["generated"], ctx.device)
    ratio = times["generated"] / times["diffusers"]
    peak = f"MFU {gen['mfu']:.1%} of {gen['peak_tflops']:.0f}" if gen["mfu"] is not None else "MFU - (no peak here)"
    return {
        "params": sum(p.numel() for p in generated.parameters()),
        "latent_tokens": tokens,
        "clip": CLIP[ctx.size],
        "dtype": str(ctx.dtype),
        "seconds": times,
        "tokens_per_s": tokens / times["generated"],
        "generated": gen,
        "ratio_generated_over_diffusers": ratio,
        "summary": f"{tokens / times['generated']:.0f} latent tok/s, {peak}, generated/diffusers {ratio:.3f}x",
    }
