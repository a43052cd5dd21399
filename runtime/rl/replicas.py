"""The collectives over the ranks that the RL job's phases share: an error agreed on by every rank (``agree``), and
the two over the data-parallel replicas that the RL job's phases share (scoring, the updates, the
offline DPO step): a per-replica tensor gathered replica-major, a per-replica statistic averaged (or maxed). One
process (``dp_size == 1``) returns its own values untouched, so single-process runs never reduce anything."""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.parallel.state import ParallelState
from runtime.rl.rewards import RewardError

__all__ = ["agree", "gather", "replica_mean"]


def gather(values: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """``values`` ``[K, B]`` of every data-parallel replica, replica-major ``[K, D * B]`` (collective)."""
    if state.dp_size == 1:
        return values
    k, b = values.shape
    parts = torch.empty((state.dp_size * k, b), dtype=values.dtype, device=values.device)
    dist.all_gather_into_tensor(parts, values.contiguous(), group=state.dp_group)
    return parts.view(state.dp_size, k, b).permute(1, 0, 2).reshape(k, -1)


def replica_mean(value: float, state: ParallelState, op: str = "mean") -> float:
    """A per-replica statistic over the data-parallel replicas (every rank gets it)."""
    if state.dp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=state.dp_group)
    return t.item() if op == "max" else t.item() / state.dp_size


def agree(error: str | None, state: ParallelState) -> None:
    """Every rank raises the first rank's error when any rank has one (collective): a rank that failed alone must
    not leave the others waiting in the next collective."""
    errors = [error]
    if state.world_size > 1:
        errors = [None] * state.world_size
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise RewardError(first)
