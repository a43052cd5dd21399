"""DiT training overhead, measured as ratios in one run.

1. forward+backward, generated shell vs the diffusers class with the same weights, parallelism off, for Wan, Flux,
   Qwen-Image, HunyuanVideo, SD3 and CogVideoX (target <= 1.02): interleaved rounds on the shared clock
   (``bench/harness.py``: user CPU time with one thread on CPU, synchronised wall time on CUDA), the ratio that of
   their fastest rounds; tokens/s and MFU of the generated model beside it;
2. activation memory per rank (bytes of tensors saved for backward) at sp=2 vs sp=1 for long video token
   sequences of Wan (self-attention), HunyuanVideo ([video, text]), SD3 ([image, text], no RoPE) and CogVideoX
   ([text, video], (b, h, s, d)) (target <= 0.6): exact and
   repeatable on CPU, unlike RSS (gloo ranks on CPU, in ``--dtype``).

Run: `.venv/bin/python bench/dit.py [--device cpu|cuda] [--dtype fp32|bf16] [--repeats 15]`.
"""

from __future__ import annotations

from typing import Any

import torch
from harness import (
    bench_args,
    fastest,
    fastest_ratio,
    flops_of,
    interleaved,
    saved_activation_bytes,
    setup,
    throughput,
    worst_rank,
)

from runtime.diffusion.registry import lookup_dit, training_class

# Bench sizes: 4-6 blocks, hidden 256-288 (8 heads), 512 tokens for the timing, 4096 for the memory ratio.
WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=8,
    attention_head_dim=36,  # RoPE t/h/w = 12/12/12
    in_channels=16,
    out_channels=16,
    text_dim=64,
    freq_dim=64,
    ffn_dim=768,
    num_layers=4,
    rope_max_seq_len=256,
)
FLUX = dict(
    patch_size=1,
    in_channels=64,
    num_layers=2,
    num_single_layers=4,
    attention_head_dim=32,
    num_attention_heads=8,
    joint_attention_dim=64,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=(8, 12, 12),
)
QWEN = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=4,
    attention_head_dim=32,
    num_attention_heads=8,
    joint_attention_dim=64,
    axes_dims_rope=(8, 12, 12),
)
HUNYUAN = dict(
    in_channels=16,
    out_channels=16,
    num_attention_heads=8,
    attention_head_dim=36,  # RoPE t/h/w = 12/12/12
    num_layers=2,
    num_single_layers=2,
    num_refiner_layers=1,
    patch_size=2,
    patch_size_t=1,
    text_embed_dim=64,
    pooled_projection_dim=32,
    rope_axes_dim=(12, 12, 12),
    guidance_embeds=True,
)
SD3 = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=4,
    attention_head_dim=32,
    num_attention_heads=8,
    joint_attention_dim=64,
    caption_projection_dim=256,
    pooled_projection_dim=32,
    pos_embed_max_size=256,  # the memory ratio's 256 x 16 patches
)
COGVIDEOX = dict(
    num_attention_heads=8,
    attention_head_dim=32,
    in_channels=16,
    out_channels=16,
    time_embed_dim=64,
    text_embed_dim=64,
    num_layers=4,
    max_text_seq_length=64,
)
# the memory ratio's models: self-attention (Wan), joint attention with text last (HunyuanVideo: video; SD3: image,
# no RoPE, split carried by kwargs) and text first (CogVideoX, (b, h, s, d))
CONFIGS = {"wan": WAN, "hunyuanvideo": HUNYUAN, "sd3": SD3, "cogvideox": COGVIDEOX}


def _inputs(model_type: str, tokens_hw: tuple[int, int], frames: int = 1, text: int = 64) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    h, w = tokens_hw
    if model_type == "wan":
        return {
            "hidden_states": torch.randn(1, 16, frames, 2 * h, 2 * w, generator=g),
            "timestep": torch.tensor([500.0]),
            "encoder_hidden_states": torch.randn(1, text, 64, generator=g),
            "return_dict": False,
        }
    if model_type == "hunyuanvideo":
        return {
            "hidden_states": torch.randn(1, 16, frames, 2 * h, 2 * w, generator=g),
            "timestep": torch.tensor([500.0]),
            "encoder_hidden_states": torch.randn(1, text, 64, generator=g),
            "encoder_attention_mask": torch.ones(1, text, dtype=torch.long),
            "pooled_projections": torch.randn(1, 32, generator=g),
            "guidance": torch.tensor([6000.0]),
            "return_dict": False,
        }
    if model_type == "sd3":  # an image of h x w tokens (frames: more rows)
        return {
            "hidden_states": torch.randn(1, 16, 2 * h * frames, 2 * w, generator=g),
            "encoder_hidden_states": torch.randn(1, text, 64, generator=g),
            "pooled_projections": torch.randn(1, 32, generator=g),
            "timestep": torch.tensor([500.0]),
            "return_dict": False,
        }
    if model_type == "cogvideox":  # frames before channels; the text length the position embeddings cover
        return {
            "hidden_states": torch.randn(1, frames, 16, 2 * h, 2 * w, generator=g),
            "encoder_hidden_states": torch.randn(1, 64, 64, generator=g),
            "timestep": torch.tensor([500]),
            "return_dict": False,
        }
    if model_type == "flux":
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        return {
            "hidden_states": torch.randn(1, h * w, 64, generator=g),
            "encoder_hidden_states": torch.randn(1, text, 64, generator=g),
            "pooled_projections": torch.randn(1, 32, generator=g),
            "timestep": torch.tensor([0.5]),
            "img_ids": torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float(),
            "txt_ids": torch.zeros(text, 3),
            "guidance": torch.tensor([3.5]),
            "return_dict": False,
        }
    return {
        "hidden_states": torch.randn(1, h * w, 64, generator=g),
        "encoder_hidden_states": torch.randn(1, text, 64, generator=g),
        "timestep": torch.tensor([0.5]),
        "img_shapes": [[(1, h, w)]],
        "return_dict": False,
    }


def _pair(model_type: str, config: dict[str, Any]) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    cls = training_class(model_type)
    generated = cls(cls.config_class(**config))
    upstream = lookup_dit(model_type).upstream_class()(**config)
    upstream.load_state_dict(generated.state_dict())
    return upstream, generated


def _on(inputs: dict[str, Any], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Inputs on the bench's device; floating tensors in its dtype (ids, masks and timesteps' dtypes kept)."""
    moved = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor):
            value = value.to(device, dtype if value.is_floating_point() and key != "timestep" else None)
        moved[key] = value
    return moved


def _cast(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(dtype)`` only when that changes anything (diffusers warns on every dtype cast)."""
    return model if dtype == torch.float32 else model.to(dtype)


def overhead(bench, model_type: str, config: dict[str, Any], inputs: dict[str, Any]) -> tuple[float, ...]:
    """(diffusers s, generated s, their ratio, FLOPs of one generated forward+backward): fastest rounds."""
    upstream, generated = (_cast(m.to(bench.device), bench.dtype) for m in _pair(model_type, config))
    inputs = _on(inputs, bench.device, bench.dtype)

    def step(model: torch.nn.Module):
        def run() -> None:
            model(**inputs)[0].float().square().mean().backward()
            model.zero_grad(set_to_none=True)

        return run

    samples = interleaved({"diffusers": step(upstream), "generated": step(generated)}, bench.repeats, bench.clock)
    up, gen = (fastest(samples[k]) for k in ("diffusers", "generated"))
    return up, gen, fastest_ratio(samples["generated"], samples["diffusers"]), flops_of(step(generated))


def _memory_worker(rank: int, world: int, model_type: str, frames: int, dtype: torch.dtype) -> int:
    from runtime.parallel.state import init_parallel_state

    init_parallel_state(sp_size=world)
    _, model = _pair(model_type, CONFIGS[model_type])
    _cast(model, dtype)
    inputs = _on(_inputs(model_type, (16, 16), frames=frames), torch.device("cpu"), dtype)
    return saved_activation_bytes(lambda: model(**inputs)[0].float().square().mean())


def activation_bytes_per_rank(model_type: str, world: int, frames: int, dtype: torch.dtype = torch.float32) -> int:
    return worst_rank(_memory_worker, world, model_type, frames, dtype)


def main() -> None:
    bench = setup(bench_args(__doc__, repeats=15).parse_args())
    print(f"forward+backward, parallelism off, generated shell vs diffusers class ({bench.label})")
    cases = [
        ("wan", WAN, _inputs("wan", (16, 16), frames=2), 512, "2 frames x 16x16 = 512 tokens"),
        ("flux", FLUX, _inputs("flux", (16, 32)), 576, "512 image + 64 text tokens"),
        ("qwenimage", QWEN, _inputs("qwenimage", (16, 32)), 576, "512 image + 64 text tokens"),
        ("hunyuanvideo", HUNYUAN, _inputs("hunyuanvideo", (16, 16), frames=2), 576, "512 video + 64 text tokens"),
        ("sd3", SD3, _inputs("sd3", (16, 32)), 576, "512 image + 64 text tokens"),
        ("cogvideox", COGVIDEOX, _inputs("cogvideox", (16, 16), frames=2), 576, "512 video + 64 text tokens"),
    ]
    for model_type, config, inputs, tokens, what in cases:
        up, gen, ratio, flops = overhead(bench, model_type, config, inputs)
        print(
            f"  {model_type:12s} {what:30s} diffusers {up * 1e3:7.1f} ms  generated {gen * 1e3:7.1f} ms  "
            f"ratio {ratio:5.3f}  (target <= 1.02)\n  {'':12s} {throughput(tokens, gen, flops, bench.device)}"
        )
    frames = 16  # 16 x 16 x 16 = 4096 video tokens
    for model_type in CONFIGS:
        one = activation_bytes_per_rank(model_type, 1, frames, bench.dtype)
        two = activation_bytes_per_rank(model_type, 2, frames, bench.dtype)
        print(f"activation memory per rank, {model_type}, {frames * 256} tokens (bytes saved for backward)")
        print(f"  sp=1 {one / 2**20:8.1f} MiB  sp=2 {two / 2**20:8.1f} MiB  ratio {two / one:7.3f}  (target <= 0.6)")


if __name__ == "__main__":
    main()
