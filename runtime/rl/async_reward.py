"""Async reward (verl-omni's name, ``docs/algo/async_reward.md`` there): the rewards of an iteration's rollout chunks
(``sampling.batch_size`` samples each) scored in a background thread while the next chunk rolls out, on every rank
(``reward_ranks: null``) or on the chosen ``reward_ranks`` (each chunk sent there as soon as it is decoded).

Why this ordering and not another: the update of iteration ``i`` needs ``i``'s rewards and the rollout of ``i + 1``
needs the policy that update makes, so an on-policy loop can hide scoring only behind the rest of the same
iteration's rollout. Pipelining rollouts one iteration ahead would hide all of it but make every rollout one update
stale (off-policy: ``rollout_correction`` would then be needed, and the numbers change); verl-omni's async reward
streams samples within the step and keeps the update on-policy, and so does this. The rewards are those of
synchronous scoring, bitwise, for any reward whose value of a sample does not depend on the other samples it is
scored with (each chunk is scored as its own batch); the last chunk's scoring is not hidden.

A reward's error is agreed on by every rank after the last chunk (``replicas.agree``), as in ``scoring.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from runtime.rl.replicas import agree, gather
from runtime.rl.scoring import local_scores, score

if TYPE_CHECKING:
    from runtime.rl.run_state import RLRun

__all__ = ["ChunkScorer"]


class ChunkScorer:
    """An iteration's rewards, chunk by chunk (``add``) then all of them (``result``: ``[1 + K, D * B]``
    replica-major on every rank, as ``scoring.score``). Synchronous (``async_reward: false``): the chunks are decoded
    and scored together at ``result``, exactly as before."""

    def __init__(self, run: RLRun, decode: Callable[[torch.Tensor], torch.Tensor], batch: int) -> None:
        self.run, self.decode, self.batch = run, decode, batch
        self.async_ = bool(run.config.async_reward)
        self.pending: list[tuple[torch.Tensor, list[str]]] = []
        self.futures: list[tuple[int, int, int, Future]] = []  # (first sample, chunk size, part, its scores)
        self.first = 0
        self.pool = None
        if self.async_:  # the scoring thread's torch ops use the loop's intra-op threads, not OpenMP's default
            threads = torch.get_num_threads()
            self.pool = ThreadPoolExecutor(1, "reward", initializer=torch.set_num_threads, initargs=(threads,))

    def add(self, final_latents: torch.Tensor, prompts: Sequence[str]) -> None:
        """One rolled-out chunk of this replica's samples (in order); collective under ``reward_ranks``."""
        first, n = self.first, len(prompts)
        self.first += n
        if self.pool is None:
            self.pending.append((final_latents, list(prompts)))
            return
        pixels = self.decode(final_latents)
        ranks, state = self.run.config.reward_ranks, self.run.state
        if ranks is None:
            self.futures.append((first, n, 0, self.pool.submit(local_scores, self.run, pixels, list(prompts))))
            return
        parts: list[Any] = [None] * state.world_size
        mine = (state.dp_rank, pixels.detach().cpu(), list(prompts)) if state.sp_rank == 0 else None
        dist.all_gather_object(parts, mine)
        ordered = sorted((p for p in parts if p is not None), key=lambda p: p[0])
        samples, texts = torch.cat([p[1] for p in ordered]), [t for p in ordered for t in p[2]]
        bounds = [len(texts) * j // len(ranks) for j in range(len(ranks) + 1)]
        if state.rank in ranks:
            j = ranks.index(state.rank)
            lo, hi = bounds[j], bounds[j + 1]
            if hi > lo:
                self.futures.append(
                    (first, n, j, self.pool.submit(local_scores, self.run, samples[lo:hi], texts[lo:hi]))
                )

    def result(self) -> torch.Tensor:
        """The global batch's rewards (collective); waits for the chunks still being scored."""
        if self.pool is None:
            pixels = torch.cat([self.decode(latents) for latents, _ in self.pending])
            return score(self.run, pixels, [t for _, texts in self.pending for t in texts])
        try:
            done = [(first, n, j, *future.result()) for first, n, j, future in self.futures]
        finally:
            self.pool.shutdown(wait=True)
        state, ranks = self.run.state, self.run.config.reward_ranks
        if ranks is None:
            agree(next((d[4] for d in done if d[4] is not None), None), state)
            return gather(torch.cat([d[3] for d in done], dim=1), state)
        answers: list[Any] = [None] * state.world_size
        dist.all_gather_object(answers, done)
        every = [d for a in answers for d in a]
        agree(next((d[4] for d in every if d[4] is not None), None), state)
        # chunk (first, n) of the global batch is every replica's samples first .. first + n, replica-major, scored
        # in contiguous parts j: place each replica's share at its rows of the [1 + K, D * B] result
        out = torch.empty((every[0][3].shape[0], state.dp_size * self.batch), dtype=every[0][3].dtype)
        for first in sorted({d[0] for d in every}):
            parts = sorted((d for d in every if d[0] == first), key=lambda d: d[2])
            chunk, n = torch.cat([d[3] for d in parts], dim=1), parts[0][1]
            for replica in range(state.dp_size):
                out[:, replica * self.batch + first : replica * self.batch + first + n] = chunk[
                    :, replica * n : (replica + 1) * n
                ]
        return out
