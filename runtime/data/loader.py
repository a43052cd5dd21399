"""The loader of the token models (text, vision, audio): tokenized samples in, one packed row per step out,
resumable. The modality says which samples it keeps and how a row is built (``text/packing.py``,
``vision/packing.py``, ``audio/packing.py``); which samples share a row, and which rank gets it, is the same for all.

Rows are planned from lengths alone (``plan_rows``), so every rank can compute the same plan cheaply, and only the
rows a rank actually uses are turned into tensors. Order, DP sharding, equal step counts and resume are the common
scheme of ``runtime/data/sampler.py``.

A plain iterator in the training process (no DataLoader workers: packing is cheap list work, and test processes are
daemonic and cannot fork workers). Rows are not padded here; ``shard_for_sp`` pads each row to a multiple of the SP
size when it slices it, so one loader serves any SP layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from runtime.data.sampler import EpochSampler, Group, Order
from runtime.data.sp_batch import IGNORE_INDEX

__all__ = ["PackedLoader", "PackedRowSampler", "WholeSampleLoader", "check_token_budget", "plan_rows", "whole_labels"]


def check_token_budget(token_budget: int) -> None:
    """ValueError unless the budget is a positive int (a bool or a float would silently misbehave later)."""
    if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1:
        raise ValueError(f"token_budget must be a positive integer, got {token_budget!r}")


def plan_rows(lengths: Sequence[int], token_budget: int, open_rows: int = 16) -> list[list[int]]:
    """Group sample positions ``0..len(lengths)-1`` into rows whose (truncated) lengths sum to at most the budget.

    Greedy first-fit over a window of ``open_rows`` rows: each sample, in the given order, goes into the first open
    row with room; when none has room a new row opens, closing the oldest open row if the window is full. The window
    keeps the cost linear and the order close to the input order (the sampler's shuffle); ``open_rows=1`` is plain
    next-fit. Rows come out in the order they close. Deterministic: a pure function of its arguments.
    """
    check_token_budget(token_budget)
    if open_rows < 1:
        raise ValueError(f"open_rows must be positive, got {open_rows}")
    closed: list[list[int]] = []
    window: list[list[int]] = []  # open rows: sample positions
    free: list[int] = []  # tokens left in each open row
    for position, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"sample {position} is empty; every sample needs at least one token")
        length = min(length, token_budget)
        k = next((k for k, room in enumerate(free) if room >= length), None)
        if k is None:
            if len(window) == open_rows:
                closed.append(window.pop(0))
                free.pop(0)
            window.append([])
            free.append(token_budget)
            k = len(window) - 1
        window[k].append(position)
        free[k] -= length
        if free[k] == 0:  # a full row can take nothing more: close it now
            closed.append(window.pop(k))
            free.pop(k)
    closed.extend(window)
    return closed


class PackedRowSampler(EpochSampler):
    """This DP rank's packed rows, each a tuple of sample indices: every epoch's permutation grouped by
    ``plan_rows`` (samples longer than the budget count as truncated to it)."""

    def __init__(
        self, lengths: Sequence[int], token_budget: int, order: Order | None = None, open_rows: int = 16
    ) -> None:
        super().__init__(Order() if order is None else order)
        if not lengths:
            raise ValueError("the sampler needs at least one sample")
        self.lengths = tuple(min(n, token_budget) for n in lengths)
        self.token_budget = token_budget
        self.open_rows = open_rows
        if not self.rank_groups(0):
            raise ValueError(
                f"{len(lengths)} samples make fewer packed rows than dp_size={self.order.dp_size}: every rank needs "
                f"at least one"
            )

    def plan(self, epoch: int) -> list[Group]:
        order = self.order.permutation(len(self.lengths), epoch)
        rows = plan_rows([self.lengths[i] for i in order], self.token_budget, self.open_rows)
        return [tuple(order[p] for p in row) for row in rows]

    def fingerprint(self) -> dict[str, int | str]:
        return {
            "num_samples": len(self.lengths),
            "num_tokens": sum(self.lengths),
            "token_budget": self.token_budget,
            "open_rows": self.open_rows,
        }


class PackedLoader:
    """Yields one batch of packed samples per step, each row at most ``token_budget`` tokens.

    Samples the modality would not use (``keeps``; say a chat whose reply lies beyond the budget) are left out up
    front, so that no row is without a target; ``num_dropped`` counts them. Order, DP sharding and resume are
    ``PackedRowSampler``'s; ``state_dict()`` is a small dict of ints. A modality subclasses it with ``keeps``,
    ``pack`` and ``requirement`` (the phrase of the "nothing usable" error).
    """

    requirement = "is usable within"

    def __init__(
        self, samples: Sequence[Any], token_budget: int, order: Order | None = None, open_rows: int = 16
    ) -> None:
        self.token_budget = token_budget
        self.samples = [s for s in samples if self.keeps(s)]
        self.num_dropped = len(samples) - len(self.samples)
        if not self.samples:
            raise ValueError(f"none of the {len(samples)} samples {self.requirement} {token_budget} tokens")
        self.sampler = PackedRowSampler([len(s) for s in self.samples], token_budget, order, open_rows)

    def keeps(self, sample: Any) -> bool:
        """Whether a sample is used at all (decided once, up front)."""
        raise NotImplementedError

    def pack(self, samples: Sequence[Any]) -> dict[str, torch.Tensor]:
        """One batch from the samples of one planned row."""
        raise NotImplementedError

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def steps_in_epoch(self, epoch: int) -> int:
        """Batches per rank in ``epoch`` (equal on every DP rank)."""
        return self.sampler.steps_in_epoch(epoch)

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.pack([self.samples[i] for i in next(self.sampler)])

    def state_dict(self) -> dict[str, int | str]:
        """Resume point: the next batch after ``load_state_dict`` is the one that would have come next."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        self.sampler.load_state_dict(state)


class WholeSampleLoader(PackedLoader):
    """The loader of samples with media (vision, audio), which are never truncated: cutting one could split a media
    item's tokens from its features. One longer than the budget is left out up front, like one without a target."""

    requirement = "fits whole and has a training target within"

    def keeps(self, sample: Any) -> bool:
        return len(sample) <= self.token_budget and bool((sample.labels[1:] != IGNORE_INDEX).any())


def whole_labels(samples: Sequence[Any], token_budget: int) -> torch.Tensor:
    """The labels ``(1, L)`` of a row of whole samples; each sample's first label is ``IGNORE_INDEX`` (nobody's
    target, as in ``text/packing.py``). ValueError when the samples do not fit the budget together."""
    check_token_budget(token_budget)
    if not samples:
        raise ValueError("a row needs at least one sample")
    total = sum(len(s) for s in samples)
    if total > token_budget:
        raise ValueError(
            f"the samples hold {total} tokens, more than the budget of {token_budget} (samples with media are never "
            f"truncated)"
        )
    labels = []
    for sample in samples:
        own = sample.labels.clone()
        own[0] = IGNORE_INDEX
        labels.append(own)
    return torch.cat(labels)[None]
