"""Ulysses SP hooks of diffusion transformers (DiTs) generated from diffusers sources.

A DiT forward under SP (every hook returns its input unchanged when SP is off, so the generated model runs
upstream's code path and stays bitwise equal to it):

1. after patchify, ``token_shard`` describes how the patchified tokens split over the SP group (padding at the end
   when their count is not divisible by sp); ``shard_tokens`` keeps this rank's contiguous slice of each per-token
   tensor and ``shard_rotary`` this rank's slice of the RoPE tables. The sharded RoPE is a ``ShardedRotary``: it
   unpacks like upstream's tuple and carries the ``TokenShard`` to every attention call that uses it.
2. each attention processor that receives RoPE runs ``ulysses_to_heads`` before its attention call and
   ``ulysses_to_sequence`` after it. Its query/key/value are ``[replicated prefix | this rank's sharded tokens]``
   along the sequence: self-attention has no prefix (Wan), joint attention has the text tokens as the prefix
   (Flux, Qwen-Image). The sharded tokens go through the Ulysses all-to-all (local tokens x all heads -> all tokens
   x this rank's heads), the prefix keeps this rank's heads, the two are joined in the head-sharded layout and the
   padding is dropped, so the attention kernel sees exactly the single-process sequence for this rank's heads.
   Afterwards the sharded part goes back through the inverse all-to-all and the prefix output is all-gathered over
   heads (every rank needs the full text stream). Attention calls without RoPE (Wan's cross-attention to text and
   image embeddings) are left alone: their queries are this rank's tokens, their keys/values are replicated, so
   they are exact without any communication.
3. ``gather_tokens`` after the output projection all-gathers the tokens and drops the padding: every rank returns
   the full prediction, as upstream does.

Why the shard rides on the RoPE object: the attention hooks need per-forward facts (the padding, where the
sharded tokens start) and RoPE is the one argument upstream already passes from the model forward to exactly the
attention calls that mix tokens, through every block and every gradient-checkpoint mechanism (diffusers', torch's
composable checkpoint, FSDP2's forward hooks rebuild containers but keep dataclasses). No global state is needed.

Gradients follow ``runtime.parallel.collectives``' partial-gradient convention, with one DiT-specific choice:
``gather_tokens``' backward keeps this rank's slice of the incoming gradient without communication, because every
SP rank computes the same loss from the same full prediction (identical inputs, noise and timesteps across the
group). The SP group's summed parameter gradients are then those of the single-process loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from runtime.parallel.collectives import (
    gather_along_dim,
    gather_heads_scatter_seq,
    gather_seq_scatter_heads,
    slice_for_rank,
    unpad,
)
from runtime.parallel.state import get_parallel_state

__all__ = [
    "ShardedRotary",
    "TokenShard",
    "gather_tokens",
    "rotary_token_shard",
    "shard_rotary",
    "shard_tokens",
    "token_shard",
    "ulysses_to_heads",
    "ulysses_to_sequence",
]


@dataclasses.dataclass(frozen=True)
class TokenShard:
    """How one forward's patchified tokens are split over the SP group.

    ``tokens`` real tokens are padded by ``pad`` to ``size * local``; rank ``rank`` holds tokens
    ``[rank * local, (rank + 1) * local)`` of the padded sequence.
    """

    group: ProcessGroup = dataclasses.field(repr=False, compare=False)
    size: int
    rank: int
    tokens: int
    pad: int

    @property
    def local(self) -> int:
        return (self.tokens + self.pad) // self.size


@dataclasses.dataclass(frozen=True)
class ShardedRotary(Sequence):
    """This rank's RoPE tables (upstream's tuple, element for element) plus the ``TokenShard`` they belong to.

    A dataclass, not a tuple subclass: FSDP2's input casting rebuilds tuples (dropping extra attributes) but
    rebuilds dataclasses field by field.
    """

    parts: tuple[Any, ...]
    shard: TokenShard

    def __iter__(self) -> Iterator[Any]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, index: Any) -> Any:
        return self.parts[index]


def _check_processors(model: torch.nn.Module, processors: tuple[type, ...]) -> None:
    for name, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is not None and not isinstance(processor, processors):
            allowed = ", ".join(sorted(p.__name__ for p in processors))
            raise ValueError(
                f"sequence parallelism needs an SP-aware attention processor on every attention module; {name} has "
                f"{type(processor).__name__} (SP-aware here: {allowed}). Keep the generated processors (do not call "
                f"set_attn_processor with another one) or train with sp_size=1."
            )


def token_shard(model: torch.nn.Module, num_tokens: int, processors: tuple[type, ...]) -> TokenShard | None:
    """The split of ``num_tokens`` patchified tokens over the SP group, or None when SP is off.

    ``processors`` are the SP-aware attention processor classes of the model's module: slicing is only correct when
    every attention runs through them, so any other processor is refused.
    """
    state = get_parallel_state()
    if not state.sp_enabled:
        return None
    _check_processors(model, processors)
    size = state.sp_size
    return TokenShard(group=state.sp_group, size=size, rank=state.sp_rank, tokens=num_tokens, pad=-num_tokens % size)


def _pad_and_slice(x: Tensor, shard: TokenShard, dim: int) -> Tensor:
    if x.size(dim) != shard.tokens:
        raise ValueError(
            f"SP token slicing: a per-token tensor of shape {tuple(x.shape)} has {x.size(dim)} entries along "
            f"dim {dim}, "
            f"expected the {shard.tokens} patchified tokens"
        )
    if shard.pad:
        shape = list(x.shape)
        shape[dim] = shard.pad
        # torch.cat rather than F.pad: RoPE tables may be complex (Qwen-Image), which F.pad does not take.
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    return slice_for_rank(x, dim, shard.group)


def shard_tokens(x: Tensor | None, shard: TokenShard | None, dim: int = 1) -> Tensor | None:
    """This rank's slice of a per-token tensor (zero-padded to the shard's length); ``x`` itself when SP is off."""
    if shard is None or x is None:
        return x
    return _pad_and_slice(x, shard, dim)


def shard_rotary(
    rotary: Any, shard: TokenShard | None, dim: int, parts: tuple[int, ...] = (0, 1), prefix: int = 0
) -> Any:
    """This rank's slice of the RoPE tables, as a ``ShardedRotary``; ``rotary`` itself when SP is off.

    ``parts`` are the indices of the per-token tables (the others, e.g. Qwen-Image's text table, stay whole);
    ``prefix`` leading entries along ``dim`` belong to replicated tokens (Flux: the text positions) and stay whole.
    """
    if shard is None:
        return rotary
    items = list(rotary)
    for i in parts:
        table = items[i]
        head, tail = table.narrow(dim, 0, prefix), table.narrow(dim, prefix, table.size(dim) - prefix)
        local = _pad_and_slice(tail, shard, dim)
        items[i] = torch.cat([head, local], dim=dim) if prefix else local
    return ShardedRotary(tuple(items), shard)


def rotary_token_shard(rotary: Any) -> TokenShard | None:
    """The ``TokenShard`` an attention call works on: the one its RoPE carries; None when SP is off or the call has
    no RoPE (cross-attention, exact without communication)."""
    return rotary.shard if isinstance(rotary, ShardedRotary) else None


def _prefix_length(x: Tensor, shard: TokenShard) -> int:
    prefix = x.size(1) - shard.local
    if prefix < 0:
        raise ValueError(
            f"SP attention: a sequence of {x.size(1)} tokens is shorter than this rank's {shard.local} sharded tokens"
        )
    return prefix


def ulysses_to_heads(
    shard: TokenShard | None, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Before attention: ``(b, prefix + local, h, d)`` -> ``(b, prefix + tokens, h / sp, d)``.

    The sharded tokens are all-to-all'ed to this rank's heads and unpadded, the replicated prefix keeps this rank's
    heads. A mask ``(b, 1, 1, prefix + local)`` over keys keeps its prefix columns and takes the sharded tokens as
    valid (Qwen-Image builds its joint mask that way: text mask, then ones). Identity when ``shard`` is None.
    """
    if shard is None:
        return query, key, value, attention_mask
    heads = query.size(2)
    if heads % shard.size:
        raise ValueError(
            f"{heads} attention heads cannot be split over sp={shard.size}: sp must divide the head count"
        )
    prefix = _prefix_length(query, shard)

    def one(x: Tensor) -> Tensor:
        local = gather_seq_scatter_heads(x.narrow(1, prefix, shard.local), seq_dim=1, head_dim=2, group=shard.group)
        local = unpad(local, 1, shard.pad)
        if not prefix:
            return local
        return torch.cat([slice_for_rank(x.narrow(1, 0, prefix), 2, shard.group), local], dim=1)

    if attention_mask is not None:
        if attention_mask.dim() != 4 or attention_mask.size(-2) != 1 or attention_mask.size(-1) != query.size(1):
            raise ValueError(
                f"SP attention takes a key mask of shape (b, 1, 1, {query.size(1)}), got {tuple(attention_mask.shape)}"
            )
        fill = True if attention_mask.dtype == torch.bool else 0.0
        tokens = attention_mask.new_full((*attention_mask.shape[:-1], shard.tokens), fill)
        attention_mask = torch.cat([attention_mask.narrow(-1, 0, prefix), tokens], dim=-1)
    return one(query), one(key), one(value), attention_mask


def ulysses_to_sequence(shard: TokenShard | None, out: Tensor) -> Tensor:
    """After attention: ``(b, prefix + tokens, h / sp, d)`` -> ``(b, prefix + local, h, d)``, the inverse of
    ``ulysses_to_heads``; the prefix output is all-gathered over heads. Identity when ``shard`` is None."""
    if shard is None:
        return out
    prefix = out.size(1) - shard.tokens
    local = out.narrow(1, prefix, shard.tokens)
    if shard.pad:
        shape = list(local.shape)
        shape[1] = shard.pad
        local = torch.cat([local, local.new_zeros(shape)], dim=1)
    local = gather_heads_scatter_seq(local, head_dim=2, seq_dim=1, group=shard.group)
    if not prefix:
        return local
    return torch.cat([gather_along_dim(out.narrow(1, 0, prefix), 2, shard.group), local], dim=1)


class _GatherForReplicatedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: ProcessGroup, size: int, rank: int) -> Tensor:
        ctx.dim, ctx.rank, ctx.chunk = dim, rank, x.size(dim)
        front = x.movedim(dim, 0).contiguous()
        out = front.new_empty((front.size(0) * size, *front.shape[1:]))
        dist.all_gather_single(out, front, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        return grad.narrow(ctx.dim, ctx.rank * ctx.chunk, ctx.chunk).contiguous(), None, None, None, None


def gather_tokens(x: Tensor, shard: TokenShard | None, dim: int = 1) -> Tensor:
    """All ranks' tokens along ``dim`` without the padding: the full per-token output; ``x`` itself when SP is off.

    Backward keeps this rank's slice of the gradient (every SP rank computes the same loss from the full output).
    """
    if shard is None:
        return x
    dim = dim % x.dim()
    return unpad(_GatherForReplicatedLoss.apply(x, dim, shard.group, shard.size, shard.rank), dim, shard.pad)
