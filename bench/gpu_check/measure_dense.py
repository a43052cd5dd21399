"""Dense LM training step (forward + backward), the generated qwen3 vs transformers' ``Qwen3ForCausalLM`` with the
same random weights: tokens/s and MFU of each, and their ratio (the brief's <= 1.02x target).

``real``: the Qwen3-1.7B config (28 layers, hidden 2048, 16/8 heads of 128, vocab 151936, tied embeddings), bf16
parameters, one packed row of 4096 tokens, sdpa attention. ``tiny``: the spec's tiny config, 64 tokens, fp32.
FLOPs: ``runtime.train.metrics.causal_lm_flops`` (6 x matmul parameters x tokens + causal attention scores).
"""

from __future__ import annotations

from typing import Any

import torch

from bench.gpu_check.common import Context, mfu, time_jobs

QWEN3_1_7B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    use_cache=False,
)
TOKENS = {"real": 4096, "tiny": 64}


def config(size: str):
    import transformers

    from runtime.models.tiny_configs import tiny_config

    if size == "tiny":
        return tiny_config("qwen3")
    cfg = transformers.AutoConfig.for_model("qwen3", **QWEN3_1_7B)
    cfg._attn_implementation = "sdpa"
    return cfg


def models(ctx: Context, cfg: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(upstream, generated) on the device in the step's dtype, same weights (initialised on the device: fast)."""
    import transformers

    from runtime.models.registry import causal_lm_class

    torch.manual_seed(0)
    with torch.device(ctx.device):
        upstream = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        generated = causal_lm_class("qwen3")(cfg)
    generated.load_state_dict(upstream.state_dict())
    return upstream.to(ctx.dtype).train(), generated.to(ctx.dtype).train()


def batch(ctx: Context, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (1, TOKENS[ctx.size]), generator=g).to(ctx.device)
    return {"input_ids": ids, "labels": ids}


def step(model: torch.nn.Module, inputs: dict[str, torch.Tensor]):
    def run() -> None:
        model(**inputs).loss.backward()
        model.zero_grad(set_to_none=True)

    return run


def run(ctx: Context) -> dict[str, Any]:
    from runtime.train.metrics import causal_lm_flops

    cfg = config(ctx.size)
    upstream, generated = models(ctx, cfg)
    inputs = batch(ctx, cfg.vocab_size)
    times = time_jobs(ctx, {"upstream": step(upstream, inputs), "generated": step(generated, inputs)})
    tokens = TOKENS[ctx.size]
    flops = causal_lm_flops(cfg, [tokens])
    gen, up = mfu(flops, times["generated"], ctx.device), mfu(flops, times["upstream"], ctx.device)
    ratio = times["generated"] / times["upstream"]
    peak = f"MFU {gen['mfu']:.1%} of {gen['peak_tflops']:.0f}" if gen["mfu"] is not None else "MFU - (no peak here)"
    return {
        "params": sum(p.numel() for p in generated.parameters()),
        "tokens": tokens,
        "dtype": str(ctx.dtype),
        "seconds": times,
        "tokens_per_s": {"generated": tokens / times["generated"], "upstream": tokens / times["upstream"]},
        "generated": gen,
        "upstream": up,
        "ratio_generated_over_upstream": ratio,
        "summary": f"{tokens / times['generated']:.0f} tok/s, {peak}, generated/upstream {ratio:.3f}x (<= 1.02)",
    }
