"""What a DiT spec states about an attention call under Ulysses SP, and the run-time checks of that statement.

The token split is applied once, after patchify; every attention call that mixes tokens sees its query/key/value as
one sequence that holds this rank's sharded tokens and, for joint attention, a segment of replicated tokens (the
text, identical on every SP rank). Where that segment sits is a property of the model's code, not something the
runtime may assume: Flux and Qwen-Image join ``[text, image]``, HunyuanVideo ``[video, text]``, Wan's
self-attention has none. The spec states it (``replicated = "none" | "first" | "last"``) together with the order of
the head and sequence dimensions (``dims = "bshd" | "bhsd"``, before the call and, when the call transposes its
arguments inline, after it: ``dit/ulysses_to_sequence``'s own ``dims``). Regen checks the order against the anchored
call where its code says it (``patchgen/cst/attention_calls.py``); the SP forward checks the statement against the
tensors (the module's head count where the stated head dim is; lengths against the split; the replicated segment
bitwise equal on every SP rank and the sharded one not), so a wrong statement raises naming the spec's patch
instead of computing a wrong result.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["AttentionLayout", "check_layout"]

REPLICATED = ("none", "first", "last")
DIMS = ("bshd", "bhsd")


@dataclasses.dataclass(frozen=True)
class AttentionLayout:
    """One attention call's layout as its spec states it; ``site`` names the spec patch for error messages."""

    replicated: str
    dims: str
    site: str = "?"

    def __post_init__(self) -> None:
        if self.replicated not in REPLICATED:
            raise ValueError(f"{self.site}: replicated must be one of {REPLICATED}, got {self.replicated!r}")
        if self.dims not in DIMS:
            raise ValueError(f"{self.site}: dims must be one of {DIMS}, got {self.dims!r}")

    def to_bshd(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2) if self.dims == "bhsd" else x

    def from_bshd(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2) if self.dims == "bhsd" else x

    def with_dims(self, dims: str | None) -> AttentionLayout:
        """The same call with its output in another stated order (``dit/ulysses_to_sequence``'s ``dims``: a call
        that transposes its arguments inline returns the other layout); itself for None."""
        return self if dims is None or dims == self.dims else dataclasses.replace(self, dims=dims)

    def check_heads(self, x: Tensor, heads: int | None, what: str) -> None:
        """Refuse a tensor whose stated head dim does not hold the attention module's ``heads`` while its stated
        sequence dim does: the dims are swapped (a call that transposes q/k/v inline has the other layout before
        it than after it). Silent when the module does not say its head count."""
        if not isinstance(heads, int) or x.dim() != 4 or x.size(2) == heads or x.size(1) != heads:
            return
        other = "bhsd" if self.dims == "bshd" else "bshd"
        raise ValueError(
            f"{self.site}: {what} of shape {tuple(x.shape)} does not match the stated dims = {self.dims!r}: its "
            f"{heads} attention heads are where the sequence should be; the tensors are {other!r} here (an attention "
            f"call that transposes its arguments inline has one layout before it and another after it): state the "
            f"dims the code has"
        )

    def check_output(self, out: Tensor, heads: int | None, span: int) -> None:
        """The attention output (``(b, s, h, d)`` already) against this rank's heads and the call's query tokens."""
        self.check_heads(out, heads, "the attention output")
        if out.dim() != 4 or out.size(1) < span:
            raise ValueError(
                f"{self.site}: the attention output of shape {tuple(out.shape)} does not match the stated dims = "
                f"{self.dims!r}: the call attended {span} sharded tokens, which that order does not hold along the "
                f"sequence dim; state the dims the output has (dit/ulysses_to_sequence's `dims`)"
            )

    def segments(self, length: int, local: int) -> tuple[int, int]:
        """(start of the sharded tokens, number of replicated tokens) in a sequence of ``length`` tokens."""
        replicated = length - local
        if replicated < 0 or (self.replicated == "none" and replicated):
            found = f"{length} tokens along the sequence dim of a {self.dims} tensor, this rank holds {local} sharded"
            expected = "exactly those" if self.replicated == "none" else "at least those"
            raise ValueError(
                f"{self.site}: the attention call does not match the stated layout (replicated = "
                f"{self.replicated!r}, dims = {self.dims!r}): {found}, expected {expected}; state the layout the "
                f"model's code builds"
            )
        return (replicated if self.replicated == "first" else 0), replicated


def _fingerprint(x: Tensor) -> Tensor:
    """Two numbers that differ when two tensors differ (in practice): the sum and a position-weighted sum."""
    flat = x.detach().reshape(-1).double()
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device).remainder_(97).add_(1)
    return torch.stack([flat.sum(), (flat * weights).sum()])


def check_layout(layout: AttentionLayout, key: Tensor, local: int, group: dist.ProcessGroup) -> None:
    """Check the stated layout on one attention call's keys (``(b, s, h, d)`` already): the lengths must fit the
    split, and the segment stated as replicated must be bitwise equal on every SP rank (sharded tokens are different
    tokens on each rank). One all-gather of two numbers; run once per model and call site (``TokenShard.checked``)."""
    _, replicated = layout.segments(key.size(1), local)
    if layout.replicated == "none" or dist.get_world_size(group) == 1:
        return
    start = 0 if layout.replicated == "first" else local
    mine = _fingerprint(key.narrow(1, start, replicated))
    everyone = mine.new_empty(dist.get_world_size(group) * mine.numel())
    dist.all_gather_single(everyone, mine, group=group)
    everyone = everyone.view(-1, mine.numel())
    if not bool((everyone == everyone[0]).all()):
        other = "last" if layout.replicated == "first" else "first"
        raise ValueError(
            f"{layout.site}: the attention call does not match the stated layout replicated = "
            f"{layout.replicated!r}: its {layout.replicated} {replicated} tokens differ between SP ranks, so they are "
            f"not the replicated ones (the model probably puts them {other}); fix the var `replicated` of this patch"
        )
