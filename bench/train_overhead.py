"""Training overhead of generated models, measured as ratios in one run.

1. forward+backward time, generated vs upstream model, parallelism off (target <= 1.02);
2. activation memory per rank (bytes of tensors saved for backward) at sp=2 vs sp=1 for a long sequence
   (target <= 0.6): exact and repeatable on CPU, unlike RSS.

Run: `.venv/bin/python bench/train_overhead.py` (part of `make bench`).
"""

from __future__ import annotations

import statistics
import time

import torch
import transformers
from harness import saved_activation_bytes, worst_rank

from runtime.data.sp_batch import shard_for_sp
from runtime.models.registry import causal_lm_class
from runtime.models.tiny import random_packed_batch, tiny_config

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


def fwd_bwd_seconds(model: torch.nn.Module, batch: dict, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(**batch).loss.backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def overhead(model_type: str = "qwen3", seq: int = 1024, repeats: int = 7) -> tuple[float, float]:
    config = tiny_config(model_type, **BENCH)
    torch.manual_seed(0)
    upstream = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    generated = causal_lm_class(model_type)(config)
    generated.load_state_dict(upstream.state_dict())
    batch = random_packed_batch((seq // 2, seq // 4, seq // 4), config.vocab_size)
    for m in (upstream, generated):  # warm-up
        fwd_bwd_seconds(m, batch, 1)
    up, gen = [], []
    for _ in range(repeats):  # interleave so drift affects both alike
        up.append(fwd_bwd_seconds(upstream, batch, 1))
        gen.append(fwd_bwd_seconds(generated, batch, 1))
    return statistics.median(up), statistics.median(gen)


def _memory_worker(rank: int, world: int, seq: int) -> int:
    from runtime.parallel.state import init_parallel_state

    state = init_parallel_state(sp_size=world)
    config = tiny_config("qwen3", **BENCH)
    torch.manual_seed(0)
    model = causal_lm_class("qwen3")(config)
    batch = shard_for_sp(random_packed_batch((seq,), config.vocab_size), state)
    return saved_activation_bytes(lambda: model(**batch, loss_chunk_size=512).loss)


def activation_bytes_per_rank(world: int, seq: int) -> int:
    return worst_rank(_memory_worker, world, seq)


def main() -> None:
    up, gen = overhead()
    print("forward+backward, parallelism off (qwen3, 4 layers, hidden 256, 1024 tokens, fp32, CPU)")
    print(f"  upstream  {up * 1e3:8.1f} ms\n  generated {gen * 1e3:8.1f} ms")
    print(f"  ratio     {gen / up:8.3f}  (target <= 1.02)")
    seq = 4096
    one, two = activation_bytes_per_rank(1, seq), activation_bytes_per_rank(2, seq)
    print(f"activation memory per rank, {seq}-token sequence, chunked loss (bytes saved for backward)")
    print(f"  sp=1 {one / 2**20:8.1f} MiB\n  sp=2 {two / 2**20:8.1f} MiB\n  ratio {two / one:7.3f}  (target <= 0.6)")


if __name__ == "__main__":
    main()
