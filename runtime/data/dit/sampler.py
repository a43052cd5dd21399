"""Which samples each data-parallel rank trains on, batch by batch, with every batch drawn from one bucket (same
latent shape): the common order scheme (``runtime/data/sampler.py``: seeded epochs, equal steps per rank, resume)
with batches planned by bucket.

Walking an epoch's permutation of the samples, each sample joins its bucket's open batch, and a batch is planned when
it holds ``batch_size`` samples; batches still open at the end of the epoch are dropped (the next permutation gives
their samples other company). Planned batch ``j`` goes to DP rank ``j % dp_size``, so a run with ``dp_size`` ranks
and ``micro_batches`` per step trains on the same batches, step by step, as one process with
``dp_size * micro_batches`` micro-batches (within an epoch; the dropped tail differs when the batch count is not a
multiple of ``dp_size``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence

from runtime.data.sampler import EpochSampler, Group, Order

__all__ = ["BucketBatchSampler"]


class BucketBatchSampler(EpochSampler):
    """Iterator over this DP rank's batches (tuples of sample indices), for ``order.num_epochs`` epochs (None:
    forever); ``buckets`` holds each sample's bucket."""

    def __init__(self, buckets: Sequence[Hashable], batch_size: int = 1, order: Order | None = None) -> None:
        super().__init__(Order() if order is None else order)
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.buckets = tuple(buckets)
        self.batch_size = batch_size
        if not self.rank_groups(0):
            counts: dict[Hashable, int] = {}
            for b in self.buckets:
                counts[b] = counts.get(b, 0) + 1
            raise ValueError(
                f"{len(self.buckets)} samples in {len(counts)} buckets (largest {max(counts.values(), default=0)}) "
                f"make fewer than dp_size={self.order.dp_size} batches of batch_size={batch_size}: every rank needs "
                f"at least one"
            )

    def plan(self, epoch: int) -> list[Group]:
        open_batches: dict[Hashable, list[int]] = {}
        batches: list[Group] = []
        for index in self.order.permutation(len(self.buckets), epoch):
            batch = open_batches.setdefault(self.buckets[index], [])
            batch.append(index)
            if len(batch) == self.batch_size:
                batches.append(tuple(batch))
                batch.clear()
        return batches

    def fingerprint(self) -> dict[str, int | str]:
        digest = hashlib.sha256(repr(self.buckets).encode()).hexdigest()[:16]
        return {"num_samples": len(self.buckets), "buckets": digest, "batch_size": self.batch_size}
