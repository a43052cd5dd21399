"""``runtime.plan``'s activation estimate (fake tensors, no device) against the peak CUDA memory of the same step
of the generated model, for the configs the dense and DiT measurements time (target: within 15%).

Measured: ``torch.cuda.max_memory_allocated`` over one forward + backward, less what was allocated before (the
parameters), with every gradient dropped as soon as it is accumulated: the plan's ``peak`` leaves parameters and
gradients out (they are counted by the layout arithmetic), as tests/gpu_readiness/test_plan.py does on CPU. Without
CUDA the estimate is still computed (the same code path) and the comparison is reported skipped.
"""

from __future__ import annotations

from typing import Any

import torch

from bench.gpu_check import measure_dense, measure_dit
from bench.gpu_check.common import Context

TOLERANCE = 0.15


def plans(size: str) -> dict[str, Any]:
    from runtime.models.tiny_configs import tiny_config_dict
    from runtime.plan.config import PlanConfig, PlanModel, Workload

    dense = tiny_config_dict("qwen3") if size == "tiny" else dict(measure_dense.QWEN3_1_7B)
    return {
        "dense": PlanConfig(PlanModel("qwen3", config=dense), Workload(tokens=measure_dense.TOKENS[size])),
        "dit": PlanConfig(PlanModel("wan", config=dict(measure_dit.CONFIGS[size])), measure_dit.workload(size)),
    }


def measured_peak(ctx: Context, name: str) -> int:
    """Peak CUDA bytes of one step above the parameters, gradients dropped as they arrive."""
    if name == "dense":
        model = measure_dense.models(ctx, measure_dense.config(ctx.size))[1]  # the upstream copy freed here
        inputs = measure_dense.batch(ctx, model.config.vocab_size)
    else:
        model = measure_dit.models(ctx)[1]
        inputs, _ = measure_dit.inputs(ctx, model.config)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = model(**inputs)
    loss = out.loss if name == "dense" else out[0].float().square().mean()
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del model, out, loss
    return peak


def run(ctx: Context) -> dict[str, Any]:
    from bench.gpu_check.common import release
    from runtime.plan.footprint import measure

    rows: dict[str, Any] = {}
    for name, plan in plans(ctx.size).items():
        estimate = measure(plan, ctx.dtype).peak
        row: dict[str, Any] = {"estimate_gib": estimate / 2**30}
        if ctx.cuda:
            release(ctx.device)
            peak = measured_peak(ctx, name)
            row.update(measured_gib=peak / 2**30, ratio=estimate / peak, within=abs(estimate / peak - 1) <= TOLERANCE)
        else:
            row["measured"] = "skipped: torch.cuda.max_memory_allocated needs a CUDA device"
        rows[name] = row
    if ctx.cuda:
        text = ", ".join(f"{n} estimate/measured {r['ratio']:.2f}" for n, r in rows.items())
        verdict = "all within 15%" if all(r["within"] for r in rows.values()) else "NOT all within 15%"
        summary = f"{text} ({verdict})"
    else:
        summary = ", ".join(f"{n} estimate {r['estimate_gib'] * 1024:.1f} MiB" for n, r in rows.items())
        summary += "; measured: skipped (no CUDA)"
    return {"plans": rows, "summary": summary}
