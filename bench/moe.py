"""MoE experts forward+backward: ours (eager reference, grouped, Triton on CUDA) vs transformers' own implementations.

Default shape (the brief's): E=64 experts, top-k 8, hidden 512, moe intermediate 512, 4096 tokens, fp32. Routing is
the Qwen3-MoE router's (softmax, top-k, renormalised) on random logits, so experts get ~T*K/E rows each, unevenly.
Upstream implementations are transformers' ``Qwen3MoeExperts`` with ``config._experts_implementation`` set to
``eager``, ``batched_mm`` and ``grouped_mm`` (``transformers.integrations.moe``); ``batched_mm`` gathers one full
weight matrix per (token, slot) and is skipped when that would not fit in memory. One timed step is forward +
backward from a fixed random output gradient; the figure is the median over ``--repeats`` steps after one warm-up,
the implementations taking turns (round-robin) so that a shared machine's load spreads over all of them.

    python bench/moe.py [--tokens 4096] [--repeats 3] [--device cpu|cuda] [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: E402

from runtime.kernels.moe_triton import triton_unavailable_reason  # noqa: E402
from runtime.moe.experts import experts_forward, pick_backend  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        hidden_act="silu",
    )
    module = Qwen3MoeExperts(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        module.gate_up_proj.normal_(0.0, args.hidden**-0.5)
        module.down_proj.normal_(0.0, args.intermediate**-0.5)
    tokens = args.tokens
    hidden = torch.randn(tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    probs = torch.softmax(torch.randn(tokens, args.experts, device=device), dim=-1)
    top_w, top_i = torch.topk(probs, args.top_k, dim=-1)
    top_w = (top_w / top_w.sum(-1, keepdim=True)).to(dtype).requires_grad_(True)
    grad_out = torch.randn(tokens, args.hidden, device=device, dtype=dtype)
    counts = torch.bincount(top_i.reshape(-1), minlength=args.experts)

    def upstream(impl: str) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            config._experts_implementation = impl
            return module(hidden, top_i, top_w)

        return run

    def ours(impl: str, backend: str | None = None) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            return experts_forward(
                hidden, top_i, top_w, module.gate_up_proj, module.down_proj, module.act_fn, impl, backend=backend
            )

        return run

    rows = tokens * args.top_k
    batched_bytes = rows * 3 * args.hidden * args.intermediate * dtype.itemsize * 2  # gathered weights + their grads
    auto = pick_backend(hidden.detach(), module.gate_up_proj.detach())
    candidates: list[tuple[str, Callable[[], torch.Tensor] | None, str]] = [
        ("upstream eager", upstream("eager"), ""),
        (
            "upstream batched_mm",
            upstream("batched_mm"),
            ""
            if batched_bytes < 0.6 * _available_bytes(device)
            else f"skipped: gathers {batched_bytes / 2**30:.0f} GiB of per-slot weights",
        ),
        ("upstream grouped_mm", upstream("grouped_mm"), ""),
        ("ours eager", ours("eager"), ""),
        (f"ours grouped (auto={auto})", ours("grouped"), ""),
        ("ours grouped backend=torch", ours("grouped", "torch"), ""),
        ("ours grouped backend=segment", ours("grouped", "segment"), ""),
        ("ours grouped backend=bmm", ours("grouped", "bmm"), ""),
    ]
    reason = triton_unavailable_reason(hidden)
    candidates.append(("ours triton", ours("triton") if reason is None else None, reason or ""))

    params = (hidden, top_w, module.gate_up_proj, module.down_proj)

    def step(fn: Callable[[], torch.Tensor]) -> float:
        for p in params:
            p.grad = None
        _sync(device)
        start = time.perf_counter()
        fn().backward(grad_out)
        _sync(device)
        return time.perf_counter() - start

    print(
        f"MoE experts fwd+bwd: tokens={tokens} experts={args.experts} top_k={args.top_k} hidden={args.hidden} "
        f"moe_intermediate={args.intermediate} dtype={args.dtype} device={device} "
        f"threads={torch.get_num_threads()} rows/expert min/mean/max="
        f"{int(counts.min())}/{rows / args.experts:.0f}/{int(counts.max())}, median of {args.repeats}"
    )
    notes: dict[str, str] = {}
    runnable: dict[str, Callable[[], torch.Tensor]] = {}
    for name, fn, note in candidates:
        if fn is None or note:
            notes[name] = note
            continue
        try:
            step(fn)  # warm-up; also finds the upstream paths that cannot run here
            runnable[name] = fn
        except Exception as exc:  # a path that cannot run here is a result, not a crash
            notes[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    # Round-robin, so that load from other processes on a shared machine hits every implementation alike.
    samples: dict[str, list[float]] = {name: [] for name in runnable}
    for _ in range(args.repeats):
        for name, fn in runnable.items():
            samples[name].append(step(fn))
    times = {name: statistics.median(ts) for name, ts in samples.items()}

    base_eager = times.get("upstream eager")
    base_fast_name = next((n for n in ("upstream grouped_mm", "upstream batched_mm") if n in times), None)
    base_fast = times.get(base_fast_name) if base_fast_name else None
    fast_label = f"vs {base_fast_name.split()[1]}" if base_fast_name else "vs upstream fast"
    print(f"{'implementation':34} {'ms':>9} {'vs upstream eager':>18} {fast_label:>18}")
    for name, _, _ in candidates:
        if name in times:
            t = times[name]
            r_eager = f"{base_eager / t:.2f}x" if base_eager else "-"
            r_fast = f"{base_fast / t:.2f}x" if base_fast else "-"
            print(f"{name:34} {t * 1e3:9.1f} {r_eager:>18} {r_fast:>18}")
        else:
            print(f"{name:34} {'-':>9}   {notes[name]}")
    print("ratios are speed-ups (upstream time / this time; > 1 is faster)")


if __name__ == "__main__":
    main()
