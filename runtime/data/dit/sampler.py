"""Which samples each data-parallel rank trains on, batch by batch, deterministically and resumably, with every
batch drawn from one bucket (same latent shape).

Every epoch, all ranks compute the same plan from the seed, the epoch and the samples' buckets alone (no
communication): walking a seeded permutation of the samples (``runtime.data.sampler.epoch_permutation``), each
sample joins its bucket's open batch, and a batch is planned when it holds ``batch_size`` samples; batches still
open at the end of the epoch are dropped (the next permutation gives their samples other company). Planned batch
``j`` goes to DP rank ``j % dp_size`` and the last ``len(batches) % dp_size`` are dropped, so every rank takes the
same number of steps (an uneven count would leave one rank waiting in an FSDP collective). SP ranks of one replica
share ``dp_rank`` and therefore get the same batches.

Because batch ``j`` goes to rank ``j % dp_size``, a run with ``dp_size`` ranks and ``micro_batches`` per step trains
on the same batches, step by step, as one process with ``dp_size * micro_batches`` micro-batches (within an epoch;
the dropped tail differs when the batch count is not a multiple of ``dp_size``).

The state is ``(epoch, position)``, equal on every rank, plus a fingerprint of what the plan depends on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence

from runtime.data.sampler import epoch_permutation

__all__ = ["BucketBatchSampler"]

_FINGERPRINT = ("num_samples", "buckets", "batch_size", "seed", "dp_size", "shuffle")


class BucketBatchSampler:
    """Iterator over this DP rank's batches (tuples of sample indices), forever."""

    def __init__(
        self,
        buckets: Sequence[Hashable],
        batch_size: int = 1,
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
    ) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.buckets = tuple(buckets)
        self.batch_size, self.seed, self.dp_rank, self.dp_size, self.shuffle = (
            batch_size,
            seed,
            dp_rank,
            dp_size,
            shuffle,
        )
        self.epoch = self.position = 0
        self._cached: tuple[int, list[tuple[int, ...]]] | None = None
        if not self.epoch_batches(0):
            counts: dict[Hashable, int] = {}
            for b in self.buckets:
                counts[b] = counts.get(b, 0) + 1
            raise ValueError(
                f"{len(self.buckets)} samples in {len(counts)} buckets (largest {max(counts.values(), default=0)}) "
                f"make fewer than dp_size={dp_size} batches of batch_size={batch_size}: every rank needs at least one"
            )

    def plan(self, epoch: int) -> list[tuple[int, ...]]:
        """Every batch of ``epoch`` in planned order (all ranks' batches)."""
        n = len(self.buckets)
        order = epoch_permutation(n, self.seed, epoch) if self.shuffle else list(range(n))
        open_batches: dict[Hashable, list[int]] = {}
        batches: list[tuple[int, ...]] = []
        for index in order:
            batch = open_batches.setdefault(self.buckets[index], [])
            batch.append(index)
            if len(batch) == self.batch_size:
                batches.append(tuple(batch))
                batch.clear()
        return batches

    def epoch_batches(self, epoch: int) -> list[tuple[int, ...]]:
        """This rank's batches of ``epoch``, in training order (the latest epoch asked for is cached)."""
        if self._cached is None or self._cached[0] != epoch:
            batches = self.plan(epoch)
            steps = len(batches) // self.dp_size
            self._cached = (epoch, batches[self.dp_rank : steps * self.dp_size : self.dp_size])
        return self._cached[1]

    def __iter__(self) -> BucketBatchSampler:
        return self

    def __next__(self) -> tuple[int, ...]:
        if self.position == len(self.epoch_batches(self.epoch)):
            self.epoch, self.position = self.epoch + 1, 0
        batch = self.epoch_batches(self.epoch)[self.position]
        self.position += 1
        return batch

    def _fingerprint(self) -> dict[str, int | str]:
        digest = hashlib.sha256(repr(self.buckets).encode()).hexdigest()[:16]
        return {
            "num_samples": len(self.buckets),
            "buckets": digest,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "dp_size": self.dp_size,
            "shuffle": int(self.shuffle),
        }

    def state_dict(self) -> dict[str, int | str]:
        return {"epoch": self.epoch, "position": self.position, **self._fingerprint()}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        """Continue exactly after the last batch taken before ``state_dict()``; ValueError if made for other data."""
        mine = self._fingerprint()
        wrong = [f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in _FINGERPRINT if state.get(k) != mine[k]]
        if wrong:
            raise ValueError("the sampler state belongs to a different run: " + "; ".join(wrong))
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.epoch_batches(epoch)):
            raise ValueError(f"sampler state out of range: epoch={epoch}, position={position}")
        self.epoch, self.position = epoch, position
