"""The text trainer's data loader: tokenized samples in, packed ``(1, L)`` batches out, resumable.

A plain iterator in the training process (no DataLoader workers: packing is cheap list work, and test processes
are daemonic and cannot fork workers). Rows are not padded here; ``shard_for_sp`` pads each row to a multiple of the
SP size when it slices it, so one loader serves any SP layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.data.packing import has_targets, pack_row
from runtime.data.sampler import PackedRowSampler
from runtime.data.tokenization import TokenizedSample
from runtime.parallel.state import ParallelState, get_parallel_state


class PackedLoader:
    """Yields ``{"input_ids", "labels", "position_ids"}``, each a LongTensor of shape ``(1, L)`` with ``L <= budget``.

    Samples that would have no training target once truncated to the budget (say a chat whose reply lies beyond it)
    are left out up front, so that no row is without a target; ``num_dropped`` counts them. Order, DP sharding and
    resume semantics are those of ``PackedRowSampler``; ``state_dict()`` is a small dict of ints.
    """

    # Subclasses for other sample types override `keeps`, `pack` and this phrase of the "nothing usable" error.
    requirement = "has a training target within"

    def __init__(
        self,
        samples: Sequence[TokenizedSample],
        token_budget: int,
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
        num_epochs: int | None = None,
        open_rows: int = 16,
    ) -> None:
        self.token_budget = token_budget
        self.samples = [s for s in samples if self.keeps(s)]
        self.num_dropped = len(samples) - len(self.samples)
        if not self.samples:
            raise ValueError(f"none of the {len(samples)} samples {self.requirement} {token_budget} tokens")
        self.sampler = PackedRowSampler(
            [len(s) for s in self.samples], token_budget, seed, dp_rank, dp_size, shuffle, num_epochs, open_rows
        )

    @classmethod
    def for_parallel_state(
        cls,
        samples: Sequence[TokenizedSample],
        token_budget: int,
        state: ParallelState | None = None,
        **kwargs,
    ) -> PackedLoader:
        """A loader for this rank's data-parallel position (the current parallel state when ``state`` is None)."""
        state = get_parallel_state() if state is None else state
        return cls(samples, token_budget, dp_rank=state.dp_rank, dp_size=state.dp_size, **kwargs)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def steps_in_epoch(self, epoch: int) -> int:
        """Batches per rank in ``epoch`` (equal on every DP rank)."""
        return self.sampler.steps_in_epoch(epoch)

    def __iter__(self) -> PackedLoader:
        return self

    def keeps(self, sample: TokenizedSample) -> bool:
        """Whether a sample is used at all (decided once, up front)."""
        return has_targets(sample, self.token_budget)

    def pack(self, samples: Sequence[TokenizedSample]) -> dict[str, torch.Tensor]:
        """One batch from the samples of one planned row."""
        row = pack_row(samples, self.token_budget)
        return {k: v.unsqueeze(0) for k, v in row.items()}

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.pack([self.samples[i] for i in next(self.sampler)])

    def state_dict(self) -> dict[str, int]:
        """Resume point: the next batch after ``load_state_dict`` is the one that would have come next."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)
