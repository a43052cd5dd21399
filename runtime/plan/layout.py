"""Per-rank bytes of a training step under an FSDP2/HSDP/SP/EP/activation-checkpointing layout, and the search for
a layout that fits (pure arithmetic on a ``Footprint``; no torch).

Per rank, with ``S = dp_shard * sp`` (FSDP2 shards over ``dp_shard x sp``, replicates over ``dp_replicate``; EP
experts shard over ``ep x edp_shard``, which is also ``S``) and ``P`` parameters:

* parameters: fp32 master weights, ``4 P / S``; gradients: fp32, ``4 P / S``; optimizer: AdamW's two fp32 moments,
  ``8 P / S``;
* gathered: the unsharded bf16 copies FSDP2 holds during the step: the root group (embeddings, heads; the root stays
  unsharded between forward and backward) ``2 P_root``, plus the largest block twice (the one computing and the
  prefetched one, routed experts counted ``1/ep``) ``2 x 2 B``, plus that block's unsharded fp32 gradient before its
  reduce-scatter ``4 B``;
* activations: the peak of live tensors other than parameters and gradients during one forward+backward of the
  micro-batch in one process, measured on fake tensors with every block checkpointed or none (``Footprint``: saved
  activations and the transient ones, e.g. the loss chunk's logits or a recomputed block), divided by ``sp``
  (Ulysses shards every activation over the sequence or over the heads; what stays replicated, e.g. a DiT's text
  conditioning, is small).

A layout fits when the sum is at most ``USABLE`` of the device memory (the rest: CUDA context, NCCL buffers, the
caching allocator's fragmentation). The proposal is the first fitting layout of ``candidates``' order, which puts
the least recomputation and communication first (checkpointing off, then the smallest sp, shard group and ep), not
the least memory: it often fills the device while a checkpointed layout would need half of it (``fitting`` lists
the runners-up with their memory).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from runtime.plan.footprint import Footprint

__all__ = ["USABLE", "Layout", "Memory", "candidates", "fitting", "per_rank", "smallest_fitting"]

USABLE = 0.9  # fraction of a device's memory a plan may fill
GIB = 2**30


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    sp: int = 1
    ep: int = 1
    activation_checkpointing: bool = False

    @property
    def gpus(self) -> int:
        return self.dp_replicate * self.dp_shard * self.sp

    def describe(self) -> str:
        ac = "on" if self.activation_checkpointing else "off"
        return (
            f"dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x sp {self.sp}, ep {self.ep}, "
            f"activation checkpointing {ac}"
        )


@dataclass(frozen=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.gathered + self.activations


def activation_bytes(fp: Footprint, sp: int, checkpointing: bool) -> float:
    """Peak bytes of live tensors other than parameters and their gradients during forward+backward (the measured
    ``Footprint.peak``, checkpointed or not), divided by ``sp`` (see the module docstring)."""
    return (fp.peak_checkpointed if checkpointing else fp.peak) / sp


def per_rank(fp: Footprint, layout: Layout) -> Memory:
    shards = layout.dp_shard * layout.sp
    block = max(
        (p + e / layout.ep for p, e in zip(fp.block_params, fp.block_expert_params, strict=True)),
        default=0,
    )
    return Memory(
        params=4 * fp.params / shards,
        grads=4 * fp.params / shards,
        optimizer=8 * fp.params / shards,
        gathered=2 * fp.root_params + 4 * block + 4 * block,
        activations=activation_bytes(fp, layout.sp, layout.activation_checkpointing),
    )


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, in O(sqrt(n)) (``--gpus`` goes up to a million)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def valid(fp: Footprint, layout: Layout) -> str | None:
    """Why ``layout`` cannot run ``fp`` (None when it can)."""
    if fp.heads and fp.heads % layout.sp:
        return f"sp={layout.sp} does not divide the {fp.heads} attention heads"
    if layout.ep > 1 and not fp.experts:
        return "ep > 1 needs routed experts"
    if fp.experts and fp.experts % layout.ep:
        return f"ep={layout.ep} does not divide the {fp.experts} experts"
    if (layout.dp_shard * layout.sp) % layout.ep:
        return f"ep={layout.ep} does not divide dp_shard x sp = {layout.dp_shard * layout.sp}"
    return None


def candidates(fp: Footprint, gpus: int) -> list[Layout]:
    """Every valid layout of ``gpus`` devices, cheapest first: checkpointing off before on, then the smallest sp,
    the smallest shard group (more HSDP replicas: less all-gather traffic), the smallest ep."""
    found = []
    for sp in _divisors(gpus):
        for dp_shard in _divisors(gpus // sp):
            # ep divides both the expert count and dp_shard x sp (``valid``): only those are tried
            for ep in _divisors(math.gcd(fp.experts, dp_shard * sp)) if fp.experts else [1]:
                for checkpointing in (False, True):
                    layout = Layout(gpus // (sp * dp_shard), dp_shard, sp, ep, checkpointing)
                    if valid(fp, layout) is None:
                        found.append(layout)
    return sorted(found, key=lambda x: (x.activation_checkpointing, x.sp, x.dp_shard * x.sp, x.ep))


def fitting(
    fp: Footprint, layouts: Iterable[Layout], gpu_bytes: float, count: int | None = None
) -> list[tuple[Layout, Memory]]:
    """The layouts of ``layouts`` whose per-rank total fits ``USABLE * gpu_bytes``, in their order, with their
    memory; at most ``count`` of them (the proposal and its runners-up)."""
    found: list[tuple[Layout, Memory]] = []
    for layout in layouts:
        if count is not None and len(found) >= count:
            break
        memory = per_rank(fp, layout)
        if memory.total <= USABLE * gpu_bytes:
            found.append((layout, memory))
    return found


def smallest_fitting(fp: Footprint, gpus: int, gpu_bytes: float) -> tuple[Layout, Memory] | None:
    """The proposal: the first layout of ``candidates`` (least recomputation and communication, not least memory)
    whose per-rank total fits ``USABLE * gpu_bytes``; None if none does."""
    first = fitting(fp, candidates(fp, gpus), gpu_bytes, 1)
    return first[0] if first else None
