"""The rewards of an iteration's global batch, on every rank: each rank scores its replica's samples, or the
``reward_ranks`` score the whole batch in chunks and send every rank the values. A reward's error is agreed on by
every rank (``replicas.agree``), so a rank that failed alone raises with the others instead of leaving them
waiting in the next collective."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from runtime.rl.replicas import agree, gather
from runtime.rl.rewards import RewardError

if TYPE_CHECKING:
    from runtime.rl.run_state import RLRun

__all__ = ["local_scores", "score"]


def local_scores(run: RLRun, samples: torch.Tensor, prompts: Sequence[str]) -> tuple[torch.Tensor | None, str | None]:
    """This rank's ``[1 + K, n]`` (combined, then each reward) for ``samples``, or the reward's error."""
    try:
        combined, each = run.rewards(samples, prompts)
    except RewardError as exc:
        return None, str(exc)
    return torch.stack([combined, *(each[n] for n in run.reward_names)]).double(), None


def score(run: RLRun, samples: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """The rewards of the global batch, ``[1 + K, D * B]`` replica-major, on every rank (collective).

    ``reward_ranks: null``: every rank scores its replica's samples. A list of ranks: the first SP rank of each
    replica sends its samples there, the listed ranks score contiguous chunks of the global batch in turn, and every
    rank receives all the values (reward models are built and run on those ranks only)."""
    state, ranks = run.state, run.config.reward_ranks
    if ranks is None:
        local, error = local_scores(run, samples, prompts)
        agree(error, state)
        return gather(local, state)
    parts: list[Any] = [None] * state.world_size
    mine = (state.dp_rank, samples.detach().cpu(), list(prompts)) if state.sp_rank == 0 else None
    dist.all_gather_object(parts, mine)
    ordered = sorted((p for p in parts if p is not None), key=lambda p: p[0])
    all_samples = torch.cat([p[1] for p in ordered])
    all_prompts = [t for p in ordered for t in p[2]]
    n = len(all_prompts)
    bounds = [n * j // len(ranks) for j in range(len(ranks) + 1)]
    result: tuple[int, torch.Tensor | None, str | None] | None = None
    if state.rank in ranks:
        j = ranks.index(state.rank)
        lo, hi = bounds[j], bounds[j + 1]
        result = (j, *local_scores(run, all_samples[lo:hi], all_prompts[lo:hi])) if hi > lo else (j, None, None)
    answers: list[Any] = [None] * state.world_size
    dist.all_gather_object(answers, result)
    answers = sorted((a for a in answers if a is not None), key=lambda a: a[0])
    agree(next((a[2] for a in answers if a[2] is not None), None), state)
    return torch.cat([a[1] for a in answers if a[1] is not None], dim=1)
