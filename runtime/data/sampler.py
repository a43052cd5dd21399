"""Which samples each data-parallel rank trains on, row by row, deterministically and resumably.

Every epoch, all ranks compute the same plan from the seed, the epoch and the sample lengths alone (no
communication): a seeded permutation of the sample indices, grouped into packed rows by ``plan_rows``. Row ``j`` of
the plan goes to DP rank ``j % dp_size``, and the last ``len(rows) % dp_size`` rows are dropped (they get other
samples next epoch) so that **every DP rank takes the same number of steps**; uneven counts would leave one rank
waiting forever in an FSDP collective. Sharding whole rows rather than samples also gives every rank rows of
similar fill. Ranks of one DP replica (its SP ranks) get identical rows because only ``dp_rank`` enters the plan;
they slice the row afterwards (``shard_for_sp``).

The state is ``(epoch, position)``: the next row is row ``position`` of this rank's share of epoch ``epoch``. Since
all ranks share the plan and the step count, the state is the same on every rank, and the state of any rank restores
any other.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from runtime.data.packing import plan_rows

# Keys checked on load: resuming with different data, budget, seed, DP size or packing cannot continue exactly.
_FINGERPRINT = ("num_samples", "num_tokens", "token_budget", "seed", "dp_size", "shuffle", "open_rows")


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> list[int]:
    """A permutation of ``range(num_samples)`` that depends only on (seed, epoch), stable across runs and machines."""
    order = list(range(num_samples))
    random.Random(f"runtime.data:{seed}:{epoch}").shuffle(order)
    return order


class PackedRowSampler:
    """Iterator over this DP rank's rows, each a tuple of sample indices, for ``num_epochs`` epochs (None: forever)."""

    def __init__(
        self,
        lengths: Sequence[int],
        token_budget: int,
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
        num_epochs: int | None = None,
        open_rows: int = 16,
    ) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        if not lengths:
            raise ValueError("the sampler needs at least one sample")
        self.lengths = tuple(min(n, token_budget) for n in lengths)
        self.token_budget = token_budget
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle = shuffle
        self.num_epochs = num_epochs
        self.open_rows = open_rows
        self.epoch = 0
        self.position = 0
        self._cached: tuple[int, list[tuple[int, ...]]] | None = None
        if not self.epoch_rows(0):
            raise ValueError(
                f"{len(lengths)} samples make fewer packed rows than dp_size={dp_size}: every rank needs at least one"
            )

    def epoch_rows(self, epoch: int) -> list[tuple[int, ...]]:
        """This rank's rows of one epoch, in training order (the latest epoch asked for is cached)."""
        if self._cached is None or self._cached[0] != epoch:
            n = len(self.lengths)
            order = epoch_permutation(n, self.seed, epoch) if self.shuffle else list(range(n))
            rows = plan_rows([self.lengths[i] for i in order], self.token_budget, self.open_rows)
            steps = len(rows) // self.dp_size
            mine = rows[self.dp_rank : steps * self.dp_size : self.dp_size]
            self._cached = (epoch, [tuple(order[p] for p in row) for row in mine])
        return self._cached[1]

    def steps_in_epoch(self, epoch: int) -> int:
        """How many rows every rank takes in ``epoch`` (the same on all ranks; may vary a little between epochs)."""
        return len(self.epoch_rows(epoch))

    def __iter__(self) -> PackedRowSampler:
        return self

    def __next__(self) -> tuple[int, ...]:
        if self.position == self.steps_in_epoch(self.epoch):
            self.epoch, self.position = self.epoch + 1, 0
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        row = self.epoch_rows(self.epoch)[self.position]
        self.position += 1
        return row

    def _fingerprint(self) -> dict[str, int]:
        return {
            "num_samples": len(self.lengths),
            "num_tokens": sum(self.lengths),
            "token_budget": self.token_budget,
            "seed": self.seed,
            "dp_size": self.dp_size,
            "shuffle": int(self.shuffle),
            "open_rows": self.open_rows,
        }

    def state_dict(self) -> dict[str, int]:
        """Where the next row comes from, plus what it is only valid for; a small dict of ints."""
        return {"epoch": self.epoch, "position": self.position, **self._fingerprint()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue exactly after the last row taken before ``state_dict()``; ValueError if made for other data."""
        mine = self._fingerprint()
        wrong = [f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in _FINGERPRINT if state.get(k) != mine[k]]
        if wrong:
            raise ValueError("the sampler state belongs to a different run: " + "; ".join(wrong))
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.steps_in_epoch(epoch):
            raise ValueError(f"sampler state out of range: epoch={epoch}, position={position}")
        self.epoch, self.position = epoch, position
