"""MoE experts forward + backward at Qwen3-30B-A3B's shapes (128 experts, top-8, hidden 2048, moe intermediate
768, 4096 tokens, bf16): ours fused Triton and grouped (``runtime.moe.experts_forward``, bench/moe.py's paths) vs
transformers' ``Qwen3MoeExperts`` with ``grouped_mm`` and ``eager``. Targets: >= 3x eager, >= 1.2x grouped_mm.
``tiny``: 8 experts, top-2, hidden 32, 64 tokens, fp32; Triton reported skipped without CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bench.gpu_check.common import Context, time_jobs

SHAPES = {
    "real": dict(experts=128, top_k=8, hidden=2048, inter=768, tokens=4096),
    "tiny": dict(experts=8, top_k=2, hidden=32, inter=24, tokens=64),
}


def run(ctx: Context) -> dict[str, Any]:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from runtime.kernels.moe_triton import triton_unavailable_reason
    from runtime.moe.experts import experts_forward

    s = SHAPES[ctx.size]
    dev, dtype = ctx.device, ctx.dtype
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        hidden_size=s["hidden"],
        moe_intermediate_size=s["inter"],
        num_experts=s["experts"],
        num_experts_per_tok=s["top_k"],
        hidden_act="silu",
    )
    module = Qwen3MoeExperts(config).to(device=dev, dtype=dtype)
    with torch.no_grad():
        module.gate_up_proj.normal_(0.0, s["hidden"] ** -0.5)
        module.down_proj.normal_(0.0, s["inter"] ** -0.5)
    hidden = torch.randn(s["tokens"], s["hidden"], device=dev, dtype=dtype, requires_grad=True)
    probs = torch.softmax(torch.randn(s["tokens"], s["experts"], device=dev), dim=-1)
    top_w, top_i = torch.topk(probs, s["top_k"], dim=-1)
    top_w = (top_w / top_w.sum(-1, keepdim=True)).to(dtype).requires_grad_(True)
    grad_out = torch.randn_like(hidden)
    params = (hidden, top_w, module.gate_up_proj, module.down_proj)

    def timed_step(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run_once() -> None:
            for p in params:
                p.grad = None
            fn().backward(grad_out)

        return run_once

    def upstream(impl: str) -> Callable[[], None]:
        def fn() -> torch.Tensor:
            config._experts_implementation = impl
            return module(hidden, top_i, top_w)

        return timed_step(fn)

    def ours(impl: str) -> Callable[[], None]:
        gate_up, down, act = module.gate_up_proj, module.down_proj, module.act_fn
        return timed_step(lambda: experts_forward(hidden, top_i, top_w, gate_up, down, act, impl))

    jobs = {"upstream eager": upstream("eager"), "upstream grouped_mm": upstream("grouped_mm")}
    jobs["ours grouped (auto)"] = ours("grouped")
    notes = {}
    reason = triton_unavailable_reason(hidden)
    if reason is None:
        jobs["ours triton"] = ours("triton")
    else:
        notes["ours triton"] = f"skipped: {reason}"
    times = time_jobs(ctx, jobs)
    best = min((n for n in times if n.startswith("ours")), key=times.get)
    vs_eager = times["upstream eager"] / times[best]
    vs_grouped = times["upstream grouped_mm"] / times[best]
    return {
        "shape": s,
        "dtype": str(dtype),
        "seconds": times,
        "notes": notes,
        "fastest_ours": best,
        "speedup_vs_eager": vs_eager,
        "speedup_vs_grouped_mm": vs_grouped,
        "summary": f"{best}: {vs_eager:.2f}x eager (>= 3), {vs_grouped:.2f}x grouped_mm (>= 1.2)"
        + "".join(f"; {k} {v}" for k, v in notes.items()),
    }
