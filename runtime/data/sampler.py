"""The one order scheme of every trainer's data: which samples each data-parallel rank takes, step by step,
deterministically and resumably.

Every epoch, all ranks compute the same plan from the seed, the epoch and the samples alone (no communication): a
seeded permutation of the sample indices (``epoch_permutation``), grouped by the sampler (packed rows for the token
models, ``runtime/data/loader.py``; one-bucket batches for DiTs, ``runtime/data/dit/sampler.py``). Group ``j`` of the
plan goes to DP rank ``j % dp_size``, and the last ``len(plan) % dp_size`` groups are dropped (their samples get
other company next epoch) so that **every DP rank takes the same number of steps**; uneven counts would leave one
rank waiting forever in an FSDP collective. Ranks of one DP replica (its SP ranks) get identical groups because only
``dp_rank`` enters the plan; they slice the batch afterwards (``shard_for_sp``).

The state is ``(epoch, position)``: the next group is group ``position`` of this rank's share of epoch ``epoch``.
Since all ranks share the plan and the step count, the state is the same on every rank, and the state of any rank
restores any other. It carries a fingerprint of what the plan depends on, checked on load.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from runtime.parallel.state import ParallelState, get_parallel_state

__all__ = ["EpochSampler", "Order", "epoch_permutation"]

Group = tuple[int, ...]


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> list[int]:
    """A permutation of ``range(num_samples)`` that depends only on (seed, epoch), stable across runs and machines."""
    order = list(range(num_samples))
    random.Random(f"runtime.data:{seed}:{epoch}").shuffle(order)
    return order


@dataclass(frozen=True)
class Order:
    """How a sampler walks its samples: the seed, this rank's data-parallel position, whether to shuffle (False: file
    order, as an eval set) and how many epochs (None: forever). The same for every modality's sampler."""

    seed: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    shuffle: bool = True
    num_epochs: int | None = None

    def __post_init__(self) -> None:
        if self.dp_size < 1 or not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={self.dp_rank}, dp_size={self.dp_size}")

    @classmethod
    def for_parallel_state(
        cls, state: ParallelState | None = None, seed: int = 0, shuffle: bool = True, num_epochs: int | None = None
    ) -> Order:
        """The order for this rank's data-parallel position (the current parallel state when ``state`` is None)."""
        state = get_parallel_state() if state is None else state
        return cls(seed, state.dp_rank, state.dp_size, shuffle, num_epochs)

    def permutation(self, num_samples: int, epoch: int) -> list[int]:
        """The sample indices in epoch ``epoch``'s order (``epoch_permutation``, or file order without shuffle)."""
        return epoch_permutation(num_samples, self.seed, epoch) if self.shuffle else list(range(num_samples))


class EpochSampler:
    """Iterator over this DP rank's groups of sample indices, one per step, for ``order.num_epochs`` epochs.

    A subclass plans an epoch (``plan``: every rank's groups, in order) and says what the plan depends on besides the
    order (``fingerprint``); this rank's share, the equal step counts, iteration and resume are the same for all.
    """

    def __init__(self, order: Order) -> None:
        self.order = order
        self.epoch = 0
        self.position = 0
        self._cached: tuple[int, list[Group]] | None = None

    def plan(self, epoch: int) -> list[Group]:
        """Every group of ``epoch`` (all ranks'), in planned order."""
        raise NotImplementedError

    def fingerprint(self) -> dict[str, int | str]:
        """What the plan depends on besides the order's seed, DP size and shuffle; a resume needs all of it equal."""
        raise NotImplementedError

    def rank_groups(self, epoch: int) -> list[Group]:
        """This rank's groups of one epoch, in training order (the latest epoch asked for is cached)."""
        if self._cached is None or self._cached[0] != epoch:
            groups, rank, size = self.plan(epoch), self.order.dp_rank, self.order.dp_size
            self._cached = (epoch, groups[rank : len(groups) // size * size : size])
        return self._cached[1]

    def steps_in_epoch(self, epoch: int) -> int:
        """How many groups every rank takes in ``epoch`` (the same on all ranks; may vary a little between epochs)."""
        return len(self.rank_groups(epoch))

    def __iter__(self) -> EpochSampler:
        return self

    def __next__(self) -> Group:
        if self.position == self.steps_in_epoch(self.epoch):
            self.epoch, self.position = self.epoch + 1, 0
        if self.order.num_epochs is not None and self.epoch >= self.order.num_epochs:
            raise StopIteration
        group = self.rank_groups(self.epoch)[self.position]
        self.position += 1
        return group

    def _valid_for(self) -> dict[str, int | str]:
        order = {"seed": self.order.seed, "dp_size": self.order.dp_size, "shuffle": int(self.order.shuffle)}
        return {**self.fingerprint(), **order}

    def state_dict(self) -> dict[str, int | str]:
        """Where the next group comes from, plus what it is only valid for; a small dict of ints and strings."""
        return {"epoch": self.epoch, "position": self.position, **self._valid_for()}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        """Continue exactly after the last group taken before ``state_dict()``; ValueError if made for other data."""
        mine = self._valid_for()
        wrong = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in mine.items() if state.get(k) != v]
        if wrong:
            raise ValueError("the sampler state belongs to a different run: " + "; ".join(wrong))
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.steps_in_epoch(epoch):
            raise ValueError(f"sampler state out of range: epoch={epoch}, position={position}")
        self.epoch, self.position = epoch, position
