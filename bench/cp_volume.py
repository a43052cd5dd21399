"""Communication volume of context parallelism per layer and rank: Ulysses, ring, and both (USP), pure arithmetic.

For a plan file's model (runtime/plan/configs/: heads, KV heads, head dim, layers) and a sequence of L tokens, each
layout ``u x r`` (Ulysses degree u, ring degree r, SP = u * r ranks, L / (u r) tokens each) gets the bytes one rank
sends per attention layer, forward + backward, in bf16 (the formulas are in docs/parallelism.md, "Choosing
Ulysses, ring or both"):

* Ulysses all-to-all over u: q, k, v before attention and the output after, each rank keeping 1/u of what it holds:
  forward ``(u-1)/u * L/(u r) * d * (2 h + 2 h_kv')`` elements, backward the same (the inverse all-to-alls), where
  ``h_kv'`` is the KV head count after the repeat that lets u split it (runtime/sp/heads.py).
* ring over r (after the all-to-all: L/r tokens, h/u query heads, h_kv'/u KV heads per rank): r-1 passes of the K and
  V blocks, ``(r-1) * L/r * 2 * h_kv'/u * d`` forward; backward twice that (K/V again plus the dK/dV accumulators).

It also prints the attention time of one ring step against its K/V transfer under stated throughput and bandwidth
assumptions (``--tflops``, ``--link-gbs``): the ring hides its communication when the step computes longer than it
sends, and the Ulysses all-to-all's time at intra-node (``--node-gbs``, u within ``--gpus-per-node``) or
inter-node bandwidth. Run: ``python bench/cp_volume.py runtime/plan/configs/qwen3-8b.yaml --tokens 131072 --causal
--layouts 8x1,16x1,8x2,4x4``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from runtime.plan.config import read_plan
from runtime.sp.heads import kv_repeat_factor

BYTES = 2  # bf16


@dataclass(frozen=True)
class Attention:
    heads: int
    kv_heads: int
    head_dim: int
    layers: int


def attention_of(model_type: str, config: dict) -> Attention:
    """The attention shape of a plan file's model (an LM's config.json keys, or a diffusers transformer's)."""
    if "num_hidden_layers" in config:
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return Attention(heads, config.get("num_key_value_heads", heads), head_dim, config["num_hidden_layers"])
    heads = config["num_attention_heads"]
    return Attention(heads, heads, config["attention_head_dim"], config["num_layers"])


@dataclass(frozen=True)
class Volume:
    ulysses_fwd: float  # elements one rank sends per layer
    ring_fwd: float
    ring_step_flops: float  # attention FLOPs of one ring step (forward)
    ring_step_bytes: float  # K/V bytes one ring step sends

    @property
    def total_bytes(self) -> float:
        """Forward + backward bytes per layer and rank."""
        return BYTES * (2 * self.ulysses_fwd + 3 * self.ring_fwd)


def volume(a: Attention, tokens: int, u: int, r: int, causal: bool) -> Volume:
    kv = a.kv_heads * kv_repeat_factor(a.heads, a.kv_heads, u)
    local = tokens / (u * r)
    ulysses = (u - 1) / u * local * a.head_dim * (2 * a.heads + 2 * kv)
    block = tokens / r * 2 * kv / u * a.head_dim  # K and V of one ring block
    # one step: the rank's L/r queries (h/u heads) against one block of L/r keys: QK^T and PV, 2 FLOPs a MAC
    step_flops = 4 * (tokens / r) ** 2 * a.heads / u * a.head_dim * (0.5 if causal else 1.0)
    return Volume(ulysses, (r - 1) * block, step_flops, BYTES * block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("plan", help="a plan file (runtime/plan/configs/*.yaml)")
    parser.add_argument("--tokens", type=int, required=True, help="sequence length L (one sample)")
    parser.add_argument("--layouts", default="8x1,8x2", help="comma-separated ulysses x ring, e.g. 8x1,8x2,4x4")
    parser.add_argument("--causal", action="store_true", help="causal attention (load-balanced: half the FLOPs)")
    parser.add_argument("--tflops", type=float, default=400.0, help="achieved bf16 attention TFLOP/s per GPU")
    parser.add_argument("--link-gbs", type=float, default=50.0, help="inter-node GB/s per GPU (400 Gb/s IB: 50)")
    parser.add_argument("--node-gbs", type=float, default=200.0, help="intra-node all-to-all GB/s per GPU (NVLink)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    args = parser.parse_args()
    plan = read_plan(args.plan)
    a = attention_of(plan.model.type, plan.model.config)
    print(
        f"{plan.model.name}: {a.heads} heads, {a.kv_heads} KV heads, head dim {a.head_dim}, {a.layers} layers, "
        f"L = {args.tokens:,} tokens, bf16"
    )
    print(
        "layout    SP  tokens/rank  Ulysses MB/layer  ring MB/layer  total GB/step  Ulysses ms/layer  "
        "ring step: compute / send ms"
    )
    for item in args.layouts.split(","):
        u, r = (int(x) for x in item.split("x"))
        v = volume(a, args.tokens, u, r, args.causal)
        ulysses_gbs = args.node_gbs if u <= args.gpus_per_node else args.link_gbs
        ulysses_ms = BYTES * 2 * v.ulysses_fwd / (ulysses_gbs * 1e9) * 1e3
        ring_step = "-"
        if r > 1:
            compute = v.ring_step_flops / (args.tflops * 1e12) * 1e3
            send = v.ring_step_bytes / (args.link_gbs * 1e9) * 1e3
            ring_step = f"{compute:.2f} / {send:.2f}"
        print(
            f"{u:>2} x {r:<2} {u * r:>5} {args.tokens / (u * r):>12,.0f} {BYTES * 2 * v.ulysses_fwd / 1e6:>17.1f} "
            f"{BYTES * 3 * v.ring_fwd / 1e6:>14.1f} {v.total_bytes * a.layers / 1e9:>14.2f} "
            f"{ulysses_ms:>17.2f}  {ring_step}"
        )


if __name__ == "__main__":
    main()
