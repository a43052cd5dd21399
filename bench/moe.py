"""MoE experts forward+backward: ours (grouped, Triton on CUDA) vs transformers' own implementations.

Default shape (the brief's): E=64 experts, top-k 8, hidden 512, moe intermediate 512, 4096 tokens, fp32. Routing is
the Qwen3-MoE router's (softmax, top-k, renormalised) on random logits, so experts get ~T*K/E rows each, unevenly.
Upstream implementations are transformers' ``Qwen3MoeExperts`` with ``config._experts_implementation`` set to
``eager``, ``batched_mm`` and ``grouped_mm`` (``transformers.integrations.moe``); ``batched_mm`` gathers one full
weight matrix per (token, slot) and is skipped when that would not fit in memory (our own eager reference path is
not timed: tests/moe compares it with these). One timed step is forward +
backward from a fixed random output gradient, timed on the shared clock (``bench/harness.py``: user CPU time with
one thread on CPU, synchronised wall time on CUDA); the implementations run in interleaved rounds (the order
alternating) after one warm-up, and each figure is the fastest of ``--repeats`` rounds.

``ours grouped (auto=...)`` is ``backend=None``: the backend ``runtime.moe.autotune`` measured fastest for this shape
during the warm-up; the bench checks it is within 5% of the fastest named backend of the same run.

    python bench/moe.py [--tokens 4096] [--repeats 11] [--device cpu|cuda] [--dtype fp32|bf16]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from harness import bench_args, fastest, fastest_ratio, interleaved, setup, throughput
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from runtime.kernels.moe_triton import triton_unavailable_reason
from runtime.moe.autotune import measured
from runtime.moe.experts import experts_forward

AUTO_TOLERANCE = 0.05  # `auto` must be within 5% of the fastest named backend of the same run


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
    parser = bench_args(__doc__, repeats=11)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=512)
    args = parser.parse_args()
    bench = setup(args)
    device, dtype = bench.device, bench.dtype

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
        ("ours grouped (auto)", ours("grouped"), ""),
        ("ours grouped backend=torch", ours("grouped", "torch"), ""),
        ("ours grouped backend=segment", ours("grouped", "segment"), ""),
        ("ours grouped backend=bmm", ours("grouped", "bmm"), ""),
    ]
    reason = triton_unavailable_reason(hidden)
    candidates.append(("ours triton", ours("triton") if reason is None else None, reason or ""))

    params = (hidden, top_w, module.gate_up_proj, module.down_proj)

    def step(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for p in params:
                p.grad = None
            fn().backward(grad_out)

        return run

    print(
        f"MoE experts fwd+bwd: tokens={tokens} experts={args.experts} top_k={args.top_k} hidden={args.hidden} "
        f"moe_intermediate={args.intermediate} rows/expert min/mean/max="
        f"{int(counts.min())}/{rows / args.experts:.0f}/{int(counts.max())}; {bench.label}"
    )
    notes: dict[str, str] = {}
    runnable: dict[str, Callable[[], None]] = {}
    for name, fn, note in candidates:
        if fn is None or note:
            notes[name] = note
            continue
        try:
            step(fn)()  # finds the upstream paths that cannot run here; `auto` measures its backends here
            runnable[name] = step(fn)
        except Exception as exc:  # a path that cannot run here is a result, not a crash
            notes[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    samples = interleaved(runnable, args.repeats, bench.clock, warmup=0)  # warmed up just above
    times = {name: fastest(ts) for name, ts in samples.items()}
    auto = sorted(set(measured().values())) or ["fixed rule: problem below runtime.moe.autotune.MIN_MACS"]

    base_eager = "upstream eager" if "upstream eager" in times else None
    base_fast = next((n for n in ("upstream grouped_mm", "upstream batched_mm") if n in times), None)
    base_fast_name = base_fast

    def speedup(base: str | None, name: str) -> str:
        """``base``'s fastest round over ``name``'s."""
        return f"{fastest_ratio(samples[base], samples[name]):.2f}x" if base else "-"

    fast_label = f"vs {base_fast_name.split()[1]}" if base_fast_name else "vs upstream fast"
    print(f"{'implementation':34} {'ms':>9} {'vs upstream eager':>18} {fast_label:>18}")
    for name, _, _ in candidates:
        if name in times:
            t = times[name]
            r_eager, r_fast = speedup(base_eager, name), speedup(base_fast, name)
            print(f"{name:34} {t * 1e3:9.1f} {r_eager:>18} {r_fast:>18}")
        else:
            print(f"{name:34} {'-':>9}   {notes[name]}")
    print("ratios are speed-ups (upstream time / this time, fastest rounds; > 1 is faster)")
    named = {n: t for n, t in times.items() if n.startswith("ours grouped backend=")}
    if "ours grouped (auto)" in times and named:
        best = min(named, key=named.get)
        gap = fastest_ratio(samples["ours grouped (auto)"], samples[best]) - 1
        verdict = "ok" if gap <= AUTO_TOLERANCE else f"NOT within {AUTO_TOLERANCE:.0%}"
        winner = best.split("=")[1]
        print(f"auto measured {', '.join(auto)}; vs the fastest named backend ({winner}): {gap:+.1%} {verdict}")
    flops = 18 * rows * args.hidden * args.intermediate  # 3 GEMMs of 2*rows*H*I (gate, up, down) x 3 for fwd+bwd
    if "ours grouped (auto)" in times:
        print(f"ours grouped (auto): {throughput(tokens, times['ours grouped (auto)'], flops, device)}")


if __name__ == "__main__":
    main()
