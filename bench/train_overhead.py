"""Training overhead of generated models, measured as ratios in one run.

1. forward+backward, generated vs upstream model, parallelism off (target <= 1.02): both run in interleaved rounds
   on the shared clock (``bench/harness.py``: user CPU time with one thread on CPU, synchronised wall time on
   CUDA), and the ratio is that of their fastest rounds; tokens/s and MFU of the generated model beside it;
2. activation memory per rank (bytes of tensors saved for backward) at sp=2 vs sp=1 for a long sequence
   (target <= 0.6): exact and repeatable on CPU, unlike RSS (gloo ranks on CPU, in ``--dtype``).

Run: `.venv/bin/python bench/train_overhead.py [--device cpu|cuda] [--dtype fp32|bf16] [--repeats 15]`
(part of `make bench`).
"""

from __future__ import annotations

import torch
import transformers
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

from runtime.data.sp_batch import shard_for_sp
from runtime.models.registry import causal_lm_class
from runtime.models.tiny_configs import random_packed_batch, tiny_config

BENCH = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    use_sliding_window=False,  # full causal attention in every layer (the tiny test config has a sliding layer)
    vocab_size=4096,
    max_position_embeddings=8192,
)


def overhead(bench, model_type: str = "qwen3", seq: int = 1024) -> tuple[float, float, float, float]:
    """(upstream s, generated s, their ratio, FLOPs of one generated forward+backward): fastest rounds."""
    config = tiny_config(model_type, **BENCH)
    torch.manual_seed(0)
    upstream = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    generated = causal_lm_class(model_type)(config)
    generated.load_state_dict(upstream.state_dict())
    upstream.to(bench.device, bench.dtype)
    generated.to(bench.device, bench.dtype)
    batch = random_packed_batch((seq // 2, seq // 4, seq // 4), config.vocab_size)
    batch = {k: v.to(bench.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def step(model: torch.nn.Module):
        def run() -> None:
            model(**batch).loss.backward()
            model.zero_grad(set_to_none=True)

        return run

    samples = interleaved({"upstream": step(upstream), "generated": step(generated)}, bench.repeats, bench.clock)
    up, gen = (fastest(samples[k]) for k in ("upstream", "generated"))
    return up, gen, fastest_ratio(samples["generated"], samples["upstream"]), flops_of(step(generated))


def _memory_worker(rank: int, world: int, seq: int, dtype: torch.dtype) -> int:
    from runtime.parallel.state import init_parallel_state

    state = init_parallel_state(sp_size=world)
    config = tiny_config("qwen3", **BENCH)
    torch.manual_seed(0)
    model = causal_lm_class("qwen3")(config).to(dtype)
    batch = shard_for_sp(random_packed_batch((seq,), config.vocab_size), state)
    return saved_activation_bytes(lambda: model(**batch, loss_chunk_size=512).loss)


def activation_bytes_per_rank(world: int, seq: int, dtype: torch.dtype = torch.float32) -> int:
    return worst_rank(_memory_worker, world, seq, dtype)


def main() -> None:
    parser = bench_args(__doc__, repeats=15)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    bench = setup(args)
    up, gen, ratio, flops = overhead(bench, seq=args.seq)
    print(f"forward+backward, parallelism off (qwen3, 4 layers, hidden 256, {args.seq} tokens; {bench.label})")
    print(f"  upstream  {up * 1e3:8.1f} ms")
    print(f"  generated {gen * 1e3:8.1f} ms  {throughput(args.seq, gen, flops, bench.device)}")
    print(f"  ratio     {ratio:8.3f}  (fastest rounds; target <= 1.02)")
    seq = 4096
    one, two = activation_bytes_per_rank(1, seq, bench.dtype), activation_bytes_per_rank(2, seq, bench.dtype)
    print(f"activation memory per rank, {seq}-token sequence, chunked loss (bytes saved for backward, CPU ranks)")
    print(f"  sp=1 {one / 2**20:8.1f} MiB\n  sp=2 {two / 2**20:8.1f} MiB\n  ratio {two / one:7.3f}  (target <= 0.6)")


if __name__ == "__main__":
    main()
