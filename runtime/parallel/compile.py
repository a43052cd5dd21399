"""``compile: true``: every transformer block compiled on its own, as torchtitan does.

Per block (the ``_no_split_modules`` blocks FSDP2 shards and checkpointing wraps) rather than the whole model: one
graph serves every block of a kind (dynamo inlines the module, so the parameters are graph inputs, not constants),
compile time does not grow with depth, and what stays outside the blocks (embeddings, the loss, a DiT's patchify,
the data-dependent parts of a VLM's vision inputs) runs eagerly. ``nn.Module.compile`` compiles in place, so
parameter names, FSDP2's hooks (applied after this) and checkpoints are unchanged.
"""

from __future__ import annotations

from torch import nn

from runtime.parallel.fsdp import block_modules

__all__ = ["apply_compile"]


def apply_compile(model: nn.Module, backend: str = "inductor") -> list[nn.Module]:
    """Compile every block of ``model`` in place (call before FSDP2 and activation checkpointing are applied)."""
    blocks = block_modules(model)
    for block in blocks:
        block.compile(backend=backend)
    return blocks
