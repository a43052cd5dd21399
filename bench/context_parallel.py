"""Context parallelism past the head count, measured in one run (issue 24).

1. activation memory per rank (bytes of tensors saved for backward, ``harness.saved_activation_bytes``: exact and
   repeatable, unlike RSS) of a long-sequence DiT at ring=2 against one process, beside Ulysses sp=2 (target
   <= 0.6): Wan (self-attention) and Flux (joint attention with replicated text), gloo ranks in ``--dtype``;
2. the Ulysses all-to-all overlap (``parallel.overlap``, ``runtime/sp/overlap.py``) at sp=2 under gloo: a DiT and a
   dense LM forward+backward step with overlap off and on, interleaved rounds (``runtime.kernels.timing``), each
   sample ending at a barrier (the group's step time), timed in wall seconds (the effect: what overlap saves is
   waiting, which CPU time does not count; on a shared machine it moves with the load, printed beside it) and in
   user CPU seconds (the cost of the asynchronous path); the ratio is that of the fastest rounds (beside it the
   ratio of the medians, to show the spread), worst rank. Off runs the synchronous code path itself (one bool check
   per attention call), so "off costs nothing" is a statement about the code.

Run: `.venv/bin/python bench/context_parallel.py [--device cpu] [--dtype fp32|bf16] [--repeats 15]`.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import torch
from dit import CONFIGS, FLUX, _cast, _inputs, _on, _pair
from harness import bench_args, fastest, fastest_ratio, interleaved, saved_activation_bytes, setup, worst_rank

MEMORY_TOKENS = (16, 16, 16)  # frames x rows x cols: 4096 video / image tokens
MEMORY_CONFIGS = {"wan": CONFIGS["wan"], "flux": FLUX}


def _memory_inputs(model_type: str) -> dict[str, Any]:
    frames, rows, cols = MEMORY_TOKENS
    if model_type == "flux":  # an image of the same token count
        return _inputs("flux", (rows * frames // 4, cols * 4))
    return _inputs(model_type, (rows, cols), frames=frames)


def _memory_worker(rank: int, world: int, model_type: str, ring: int, dtype: torch.dtype) -> int:
    from runtime.parallel.state import init_parallel_state

    init_parallel_state(sp_size=world, ring_size=ring)
    _, model = _pair(model_type, MEMORY_CONFIGS[model_type])
    _cast(model, dtype)
    inputs = _on(_memory_inputs(model_type), torch.device("cpu"), dtype)
    return saved_activation_bytes(lambda: model(**inputs)[0].float().square().mean())


def _timing_worker(rank: int, world: int, repeats: int, device: str, dtype: torch.dtype) -> dict[str, float]:
    """{"<model> <clock>": on/off ratio, "<model> <clock> off|on": seconds} of this rank's fastest rounds, for the
    wall clock (the overlap's effect: what it saves is waiting, which CPU time does not count) and the user CPU clock
    (the cost of the asynchronous path: the same work, so ~1)."""
    import torch.distributed as dist
    from harness import Clock

    from runtime.data.sp_batch import shard_for_sp
    from runtime.parallel.state import init_parallel_state
    from runtime.sp.overlap import overlap
    from tests.parity.dense import models, packed_batch

    torch.set_num_threads(1)
    state = init_parallel_state(sp_size=world)
    _, dit = _pair("wan", CONFIGS["wan"])
    _cast(dit, dtype)
    dit_inputs = _on(_inputs("wan", (16, 16), frames=4), torch.device(device), dtype)  # 1024 tokens
    _, lm = models(
        "qwen3",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        num_hidden_layers=4,
    )
    lm_batch = shard_for_sp(packed_batch((700, 500, 848)), state)  # 2048 tokens

    def step(model: torch.nn.Module, run: Any, enabled: bool):
        def go() -> None:
            with overlap(enabled):
                run().backward()
            model.zero_grad(set_to_none=True)
            # a sample ends when the slowest rank is done: the group's step time, and the next sample starts together
            dist.barrier(group=state.sp_group)

        return go

    result = {}
    for name, model, run in (
        ("wan", dit, lambda: dit(**dit_inputs)[0].float().square().mean()),
        ("qwen3", lm, lambda: lm(**lm_batch).loss),
    ):
        for clock_name, clock in (("wall", Clock(device, wall=True)), ("cpu", Clock(device))):
            jobs = {"off": step(model, run, False), "on": step(model, run, True)}
            samples = interleaved(jobs, repeats, clock)
            key = f"{name} {clock_name}"
            result[key] = fastest_ratio(samples["on"], samples["off"])
            result[f"{key} off"], result[f"{key} on"] = fastest(samples["off"]), fastest(samples["on"])
            result[f"{key} median"] = statistics.median(samples["on"]) / statistics.median(samples["off"])
    return result


def main() -> None:
    bench = setup(bench_args(__doc__, repeats=15).parse_args())
    print(f"context parallelism ({bench.label})")
    tokens = MEMORY_TOKENS[0] * MEMORY_TOKENS[1] * MEMORY_TOKENS[2]
    for model_type in MEMORY_CONFIGS:
        one = worst_rank(_memory_worker, 1, model_type, 1, bench.dtype)
        ulysses = worst_rank(_memory_worker, 2, model_type, 1, bench.dtype)
        ring = worst_rank(_memory_worker, 2, model_type, 2, bench.dtype)
        print(f"activation memory per rank, {model_type}, {tokens} tokens (bytes saved for backward)")
        print(
            f"  sp=1 {one / 2**20:8.1f} MiB  ulysses=2 {ulysses / 2**20:8.1f} MiB (ratio {ulysses / one:5.3f})  "
            f"ring=2 {ring / 2**20:8.1f} MiB (ratio {ring / one:5.3f}, target <= 0.6)"
        )
    from tests.dist_utils import run_distributed

    per_rank = run_distributed(_timing_worker, 2, bench.repeats, bench.device.type, bench.dtype, timeout=1800)
    load = os.getloadavg()[0]
    print(f"Ulysses all-to-all overlap at sp=2 (gloo), fwd+bwd, on / off, worst rank (load average {load:.1f})")
    for name, what in (("wan", "Wan, 1024 tokens"), ("qwen3", "dense LM, 2048 packed tokens")):
        for clock, unit in (("wall", "wall"), ("cpu", "user CPU")):
            key = f"{name} {clock}"
            worst = max(per_rank, key=lambda r: r[key])
            print(
                f"  {what:28s} {unit:8s} off {worst[f'{key} off'] * 1e3:7.1f} ms  on {worst[f'{key} on'] * 1e3:7.1f} "
                f"ms  ratio {worst[key]:5.3f} (medians: {worst[f'{key} median']:5.3f})"
            )


if __name__ == "__main__":
    main()
