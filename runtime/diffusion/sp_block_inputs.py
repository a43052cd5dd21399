"""Block inputs left whole under the token split: one error line instead of a broadcast crash inside a block.

Under SP the blocks of a DiT run on this rank's slice of the tokens. A per-token conditioning tensor (Wan2.2 TI2V's
per-token timesteps, SkyReels-V2's per-frame timesteps repeated over each frame's tokens) that no
``dit/shard_per_token`` patch slices reaches the blocks with every token and meets the hidden states in a broadcast:
torch then stops with "The size of tensor a (N) must match the size of tensor b (M)", naming neither the spec nor
the fix. The blocks are the narrowest place that knows both lengths: each call of a block that receives the split
(its carrier: the sharded RoPE, a ``TokenShard``, or a kwargs dict holding one) is checked before it runs, and a
tensor input that holds the full token count (padded or not) along a token dimension is refused, naming the spec's
``dit/shard_tokens`` site, the block, the input and the patch to add.

What counts as a token dimension: any but the batch (first) and channel (last) dimensions, so a hidden size that
happens to equal the token count is no false alarm; inputs named ``encoder_*`` (text, image embeddings and their
masks: replicated on purpose) are left alone.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import Tensor, nn

__all__ = ["watch_block_inputs"]

_WATCHED = "_patchgen_sp_block_inputs_watched"


def watch_block_inputs(model: nn.Module, site: str) -> None:
    """Once per model: check the inputs of every block (the elements of the model's top-level ``ModuleList``s) at
    each call that receives the token split (``check_block_inputs``). Blocks that never receive it are not
    checked; with SP off no block receives it."""
    if model.__dict__.get(_WATCHED):
        return
    model.__dict__[_WATCHED] = True
    for list_name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            for index, block in enumerate(child):
                hook = functools.partial(_pre_hook, name=f"{list_name}.{index}", site=site)
                block.register_forward_pre_hook(hook, with_kwargs=True)


def _pre_hook(module: nn.Module, args: tuple, kwargs: dict, name: str, site: str) -> None:
    check_block_inputs(module, args, kwargs, name, site)


def _split_of(item: Any) -> Any:
    """The token split ``item`` carries: a ``TokenShard`` (its ``tokens``, ``pad`` and ``local``) or the sharded
    RoPE holding one (its ``shard``); None for anything else. Read by its fields, not its class: runtime.diffusion.sp
    imports this module to hook the blocks."""
    shard = getattr(item, "shard", item)
    return shard if all(hasattr(shard, field) for field in ("tokens", "pad", "local")) else None


def _carried_shard(values: list[Any]) -> Any:
    for value in values:
        inner = list(value.values()) if isinstance(value, dict) else [value]
        for item in inner:
            if (shard := _split_of(item)) is not None:
                return shard
    return None


@functools.lru_cache(maxsize=256)
def _parameter_names(forward: Any) -> tuple[str, ...]:
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def check_block_inputs(module: nn.Module, args: tuple, kwargs: dict, name: str, site: str) -> None:
    """Raise one line when a tensor input of block ``name`` holds every token (the full or padded count) along a
    token dimension while the split gives this rank ``local`` of them; nothing when the call carries no split."""
    shard = _carried_shard([*args, *kwargs.values()])
    if shard is None:
        return
    full = {shard.tokens, shard.tokens + shard.pad} - {shard.local}
    names = _parameter_names(type(module).forward)
    named = [(names[i + 1] if i + 1 < len(names) else f"argument {i}", a) for i, a in enumerate(args)]
    for arg, value in [*named, *kwargs.items()]:
        if not isinstance(value, Tensor) or arg.startswith("encoder_"):
            continue
        for dim in range(1, value.dim() - 1):
            if value.size(dim) in full:
                raise ValueError(
                    f"sequence parallelism ({site}): input {arg!r} of block {name} has shape {tuple(value.shape)}, "
                    f"{value.size(dim)} entries along dim {dim}: every token, but the blocks run on this rank's "
                    f"{shard.local} of {shard.tokens}; a per-token (or per-frame, expanded to tokens) conditioning "
                    f"tensor must be sharded with the tokens: add a dit/shard_per_token patch (tensor = the "
                    f"variable it is computed into, its token dim) before the blocks to the spec, or train with sp=1"
                )
