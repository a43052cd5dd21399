"""Ulysses (and Ulysses x ring) SP hooks of diffusion transformers (DiTs) generated from diffusers sources.

A DiT forward under SP (every hook returns its input unchanged when SP is off, so the generated model runs
upstream's code path and stays bitwise equal to it):

1. after patchify, ``token_shard`` describes how the patchified tokens split over the SP group (padding at the end
   when their count is not divisible by sp); ``shard_tokens`` keeps this rank's contiguous slice of each per-token
   tensor and ``shard_rotary`` this rank's slice of the RoPE tables. The sharded RoPE is a ``ShardedRotary``: it
   unpacks like upstream's tuple and carries the ``TokenShard`` to every attention call that uses it.
2. each attention processor that receives the split runs ``ulysses_to_heads`` before its attention call and
   ``ulysses_to_sequence`` after it. Its query/key/value hold this rank's sharded tokens and, for joint attention,
   a segment of replicated tokens (the text) whose place the spec states (``runtime/diffusion/sp_layout.py``:
   ``replicated`` none / first / last, ``dims`` bshd / bhsd; checked at the first SP forward). The sharded tokens go
   through the Ulysses all-to-all (local tokens x all heads -> all tokens x this rank's heads), the replicated
   segment keeps this rank's heads, the two are joined in the stated order and the padding is dropped, so the
   attention kernel sees exactly the single-process sequence for this rank's heads. Afterwards the sharded part
   goes back through the inverse all-to-all and the replicated output is all-gathered over heads (every rank needs
   the full text stream). Attention calls that do not receive the split (Wan's cross-attention to text and image
   embeddings) are left alone: their queries are this rank's tokens, their keys/values are replicated, so they are
   exact without any communication.
   Under a ring (``parallel.ring`` > 1, SP = ulysses x ring) the all-to-all runs within the Ulysses group and
   leaves this rank the contiguous span of ``ulysses x local`` tokens its ring rank owns, in queries, keys and values
   (padding included), and the attention call itself becomes ``runtime.sp.ring``'s ``ring_attention`` over the ring
   group (``runtime/diffusion/sp_ring.py``, the ``dit/ring_attention`` patch), with the padding and masked keys
   hidden and the replicated text K/V as its ``extra_kv`` (seen once by every query).
3. ``gather_tokens`` after the output projection all-gathers the tokens and drops the padding: every rank returns
   the full prediction, as upstream does.

Why the shard rides on the RoPE object: the attention hooks need per-forward facts (the padding, the number of
real tokens) and RoPE is the one argument upstream already passes from the model forward to exactly the attention
calls that mix tokens, through every block and every gradient-checkpoint mechanism (FSDP2's forward hooks rebuild
containers but keep dataclasses). No global state is needed. A single RoPE tensor (Lumina2's complex ``freqs_cis``)
rides the same way, wrapped; the processor unwraps it where upstream uses it (``rotary_tensor``). Which processor
argument carries the split is the spec's statement (the ``carrier`` var of ``dit/ulysses_to_heads``);
``attention_split`` accepts a ``ShardedRotary`` or a bare ``TokenShard``.

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

from runtime.diffusion.sp_block_inputs import watch_block_inputs
from runtime.diffusion.sp_layout import AttentionLayout, check_layout
from runtime.parallel.collectives import gather_along_dim, gather_heads_scatter_seq, slice_for_rank, unpad
from runtime.parallel.sites import mark_site
from runtime.parallel.state import get_parallel_state
from runtime.sp.overlap import seq_to_heads

__all__ = [
    "AttentionSplit", "ShardedRotary", "TokenShard", "attention_split", "carry_token_shard", "gather_tokens",
    "refuse_under_sp", "rotary_tensor", "shard_rotary", "shard_tokens", "token_shard", "ulysses_to_heads",
    "ulysses_to_sequence",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TokenShard:
    """How one forward's patchified tokens are split over the SP group.

    ``tokens`` real tokens are padded by ``pad`` to ``size * local``; rank ``rank`` holds tokens
    ``[rank * local, (rank + 1) * local)`` of the padded sequence. ``checked``: the attention sites whose stated
    layout was already checked for this model (shared by all its forwards: the check runs once per site).
    Under Ulysses x ring (``size = ulysses_size * ring_size``, ``rank = ring_rank * ulysses_size + ulysses_rank``)
    the all-to-all runs over ``ulysses_group`` and the K/V gather over ``ring_group`` (None: a dim of size 1).
    """

    group: ProcessGroup = dataclasses.field(repr=False, compare=False)
    size: int
    rank: int
    tokens: int
    pad: int
    checked: set = dataclasses.field(default_factory=set, repr=False, compare=False)
    ulysses_group: ProcessGroup | None = dataclasses.field(default=None, repr=False, compare=False)
    ring_group: ProcessGroup | None = dataclasses.field(default=None, repr=False, compare=False)
    ring_size: int = 1

    @property
    def local(self) -> int:
        return (self.tokens + self.pad) // self.size

    @property
    def ulysses_size(self) -> int:
        return self.size // self.ring_size

    @property
    def span(self) -> int:
        """Query tokens of one attention call after the all-to-all: every real token, or under a ring this ring
        rank's contiguous ``ulysses_size * local`` tokens of the padded sequence (padding included)."""
        return self.tokens if self.ring_size == 1 else self.local * self.ulysses_size


@dataclasses.dataclass(frozen=True)
class ShardedRotary(Sequence):
    """This rank's RoPE tables (upstream's tuple, element for element) plus the ``TokenShard`` they belong to;
    ``single``: upstream's RoPE is one tensor, ``parts[0]`` (``rotary_tensor`` unwraps it).

    A dataclass, not a tuple subclass: FSDP2's input casting rebuilds tuples (dropping extra attributes) but
    rebuilds dataclasses field by field.
    """

    parts: tuple[Any, ...]
    shard: TokenShard
    single: bool = False

    def __iter__(self) -> Iterator[Any]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, index: Any) -> Any:
        return self.parts[index]


def _check_processors(
    model: torch.nn.Module, processors: tuple[type, ...], replicated_modules: tuple[str, ...], site: str
) -> None:
    for name, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None or isinstance(processor, processors):
            continue
        if any(name == prefix or name.startswith(prefix + ".") for prefix in replicated_modules):
            continue  # stated by the spec: runs before the split, on replicated tokens only
        got, names = type(processor), {p.__name__ for p in processors}
        same_name = got.__name__ in names  # upstream's class beside its generated copy: say which is which
        shown = (lambda cls: f"{cls.__module__}.{cls.__qualname__}") if same_name else (lambda cls: cls.__name__)
        allowed = ", ".join(sorted(shown(p) for p in processors))
        where = f"{got.__module__} (a shared module), so that module must be a companion of the spec"
        copy = f"; it is upstream's class of that name, not the generated copy: it was imported from {where}"
        copy = copy if same_name else ""
        raise ValueError(
            f"sequence parallelism: attention module {name} has {shown(got)}, which is not SP-aware "
            f"(SP-aware here: {allowed}){copy}. If {name} runs before the token split on replicated tokens only (e.g. "
            f"a text refiner), add {name.split('.')[0]!r} to the var `replicated_modules` of {site}; if "
            f"set_attn_processor replaced the generated processor, keep the generated one; or train with sp=1."
        )


def token_shard(
    model: torch.nn.Module,
    num_tokens: int,
    processors: tuple[type, ...],
    replicated_modules: tuple[str, ...] = (),
    site: str = "the dit/shard_tokens patch",
    rows: int | None = None,
) -> TokenShard | None:
    """The split of ``num_tokens`` patchified tokens over the SP group, or None when SP is off.

    ``processors`` are the SP-aware attention processor classes of the model's module: slicing is only correct when
    every attention runs through them, so any other processor is refused, except under ``replicated_modules``
    (module paths the spec declares as running before the split on replicated tokens, e.g. a text refiner).
    ``rows``: a token grid's row count that must split into whole rows per rank (Sana's conv FFN), else refused.
    """
    state = get_parallel_state()
    if not state.sp_enabled:
        return None
    _check_processors(model, processors, replicated_modules, site)
    watch_block_inputs(model, site)  # a per-token tensor left whole: one line, not a broadcast crash
    size = state.sp_size
    if rows is not None and rows % size:
        raise ValueError(
            f"sequence parallelism ({site}): the {rows} rows of the token grid do not split into whole rows over "
            f"sp={size} (a convolution over the grid needs whole rows per rank); use a height whose patch rows "
            f"divide by {size}, or train with sp=1"
        )
    checked = model.__dict__.setdefault("_patchgen_sp_checked_sites", set())
    return TokenShard(
        group=state.sp_group,
        size=size,
        rank=state.sp_rank,
        tokens=num_tokens,
        pad=-num_tokens % size,
        checked=checked,
        ulysses_group=state.ulysses_group,
        ring_group=state.ring_group,
        ring_size=state.ring_size,
    )


def refuse_under_sp(condition: Any, reason: str, site: str = "?") -> None:
    """Raise when SP is on and ``condition`` holds: a configuration the token split would make silently wrong."""
    if condition and get_parallel_state().sp_enabled:
        raise ValueError(f"sequence parallelism cannot run this configuration ({site}): {reason}; train with sp=1")


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
    A single tensor (``parts`` unused) is sliced whole and wrapped with ``single=True``.
    """
    if shard is None or rotary is None:
        return rotary
    single = isinstance(rotary, Tensor)
    items = [rotary] if single else list(rotary)
    for i in (0,) if single else parts:
        table = items[i]
        head, tail = table.narrow(dim, 0, prefix), table.narrow(dim, prefix, table.size(dim) - prefix)
        local = _pad_and_slice(tail, shard, dim)
        items[i] = torch.cat([head, local], dim=dim) if prefix else local
    return ShardedRotary(tuple(items), shard, single)


def rotary_tensor(rotary: Any) -> tuple[ShardedRotary | None, Any]:
    """(the carrier, upstream's RoPE tensor) inside a processor whose RoPE is one tensor: ``shard_rotary`` wrapped
    it to carry the split, upstream's code needs the tensor. ``(None, rotary)`` for anything else (SP off, a call
    that receives no split, e.g. a refiner before the split)."""
    if isinstance(rotary, ShardedRotary) and rotary.single:
        return rotary, rotary.parts[0]
    return None, rotary


def carry_token_shard(kwargs: dict | None, shard: TokenShard | None, key: str = "dit_sp") -> dict | None:
    """``kwargs`` (a dict the blocks pass on to their attention processors) with the split under ``key``; ``kwargs``
    itself when SP is off, so the generated model passes exactly what upstream passes."""
    if shard is None:
        return kwargs
    return {**(kwargs or {}), key: shard}


@dataclasses.dataclass(frozen=True)
class AttentionSplit:
    """One attention call under SP: the forward's token split and the layout its spec states."""

    shard: TokenShard
    layout: AttentionLayout
    heads: int | None = None  # the attention module's head count, where it says it (checks the stated dims)


def attention_split(
    carrier: Any, *, replicated: str, dims: str, site: str = "?", module: Any = None
) -> AttentionSplit | None:
    """The split an attention call works on: the ``TokenShard`` its carrier argument holds (a ``ShardedRotary`` or a
    bare ``TokenShard``), with the stated layout (``sp_layout``); None when SP is off or the call does not receive
    the split (cross-attention: exact without communication). ``module``, the attention module of the call, is
    marked as having passed a checked site (``runtime.parallel.sites``) either way."""
    mark_site(module)
    if isinstance(carrier, ShardedRotary):
        carrier = carrier.shard
    if not isinstance(carrier, TokenShard):
        return None
    return AttentionSplit(carrier, AttentionLayout(replicated, dims, site), getattr(module, "heads", None))


def _joined(layout: AttentionLayout, replicated: Tensor, sharded: Tensor) -> Tensor:
    parts = [replicated, sharded] if layout.replicated == "first" else [sharded, replicated]
    return torch.cat(parts, dim=1)


def _sharded_key_mask(shard: TokenShard, local: Tensor) -> Tensor:
    """The key-mask columns of the sharded tokens, from every rank's own columns (gathered over the whole SP group,
    so a sharded key the model masks stays masked): all real tokens under Ulysses, every ring rank's span (padding
    included, ``size * local`` columns) under a ring, where ``sp_ring`` hides each span's masked keys."""
    flag = local.dtype == torch.bool
    full = gather_along_dim(local.to(torch.uint8) if flag else local, 3, shard.group)
    full = full.bool() if flag else full
    return unpad(full, 3, shard.pad) if shard.ring_size == 1 else full


def ulysses_to_heads(
    split: AttentionSplit | None, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Before attention: this rank's sharded tokens x all heads (+ a replicated segment) -> every token x this rank's
    heads, in the stated layout. The sharded tokens are all-to-all'ed and unpadded, the replicated segment keeps
    this rank's heads. A key mask ``(b, 1, 1, s)`` keeps its replicated columns and gathers the sharded tokens'
    columns from every rank (``_sharded_key_mask``: a sharded key the model masks stays masked). Under a ring the
    all-to-all runs over the Ulysses group and queries, keys and values keep this ring rank's span
    (``TokenShard.span``, padding included) for ``runtime.diffusion.sp_ring``'s ring attention, and the mask keeps
    every ring rank's columns. Identity when ``split`` is None.
    """
    if split is None:
        return query, key, value, attention_mask
    shard, layout = split.shard, split.layout
    query, key, value = (layout.to_bshd(x) for x in (query, key, value))
    layout.check_heads(query, split.heads, "the query before the attention call")
    heads = query.size(2)
    if heads % shard.ulysses_size:
        raise ValueError(
            f"{heads} attention heads cannot be split over ulysses={shard.ulysses_size}: the Ulysses degree must "
            f"divide the head count (parallel.ring grows SP past it)"
        )
    start, count = layout.segments(query.size(1), shard.local)
    if layout.site not in shard.checked:
        check_layout(layout, key, shard.local, shard.group)
        shard.checked.add(layout.site)
    rep_start = 0 if layout.replicated == "first" else shard.local

    sharded = seq_to_heads(
        [x.narrow(1, start, shard.local) for x in (query, key, value)],
        seq_dim=1,
        head_dim=2,
        group=shard.ulysses_group,
    )

    def one(x: Tensor, local: Tensor) -> Tensor:
        if shard.ring_size == 1:  # under a ring the span keeps its padding: ring_attention hides it
            local = unpad(local, 1, shard.pad)
        if not count:
            return layout.from_bshd(local)
        text = slice_for_rank(x.narrow(1, rep_start, count), 2, shard.ulysses_group)
        return layout.from_bshd(_joined(layout, text, local))

    if attention_mask is not None:
        if attention_mask.dim() != 4 or attention_mask.size(-2) != 1 or attention_mask.size(-1) != query.size(1):
            raise ValueError(
                f"{layout.site}: SP attention takes a key mask of shape (b, 1, 1, {query.size(1)}), got "
                f"{tuple(attention_mask.shape)}"
            )
        tokens = _sharded_key_mask(shard, attention_mask.narrow(-1, start, shard.local))
        kept = attention_mask.narrow(-1, rep_start, count)
        attention_mask = torch.cat([kept, tokens] if layout.replicated == "first" else [tokens, kept], dim=-1)
    query, key, value = (one(x, local) for x, local in zip((query, key, value), sharded, strict=True))
    return query, key, value, attention_mask


def ulysses_to_sequence(split: AttentionSplit | None, out: Tensor, dims: str | None = None) -> Tensor:
    """After attention: every token x this rank's heads -> this rank's sharded tokens x all heads (+ the replicated
    segment, all-gathered over heads), the inverse of ``ulysses_to_heads``, in the order ``dims`` states (a call
    that transposes q/k/v inline returns another) or the one stated before it. Identity when ``split`` is None."""
    if split is None:
        return out
    shard, layout = split.shard, split.layout.with_dims(dims)
    out = layout.to_bshd(out)
    layout.check_output(out, split.heads and split.heads // shard.ulysses_size, shard.span)
    count = out.size(1) - shard.span
    start = count if layout.replicated == "first" else 0
    local = out.narrow(1, start, shard.span)
    if shard.pad and shard.ring_size == 1:
        shape = list(local.shape)
        shape[1] = shard.pad
        local = torch.cat([local, local.new_zeros(shape)], dim=1)
    local = gather_heads_scatter_seq(local, head_dim=2, seq_dim=1, group=shard.ulysses_group)
    if not count:
        return layout.from_bshd(local)
    rep_start = 0 if layout.replicated == "first" else shard.span
    full = gather_along_dim(out.narrow(1, rep_start, count), 2, shard.ulysses_group)
    return layout.from_bshd(_joined(layout, full, local))


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
