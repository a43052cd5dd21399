"""Pack tokenized samples into rows of at most ``token_budget`` tokens.

A row is the concatenation of whole samples. Its ``position_ids`` restart at 0 for every sample, which is what the
generated models use to build the packing mask (no attention across samples) and RoPE. Labels stay unshifted, but
the label of each sample's first token is set to ``IGNORE_INDEX``: the SP loss shifts labels over the whole row
(``target[t] = labels[t + 1]``), so without this the last token of one sample would be trained to predict the first
token of the next one.

Samples longer than the budget are **truncated** to their first ``token_budget`` tokens rather than split: a
continuation piece would restart its position ids mid-document without the context it depends on, and for chat it
would be a conversation cut in half. The data reader (``split_documents``) keeps plain-text documents short instead.

Rows are planned from lengths alone (``plan_rows``), so every rank can compute the same plan cheaply, and only the
rows a rank actually uses are turned into tensors (``pack_row``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.data.sp_batch import IGNORE_INDEX
from runtime.data.tokenization import TokenizedSample


def check_token_budget(token_budget: int) -> None:
    """ValueError unless the budget is a positive int (a bool or a float would silently misbehave later)."""
    if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1:
        raise ValueError(f"token_budget must be a positive integer, got {token_budget!r}")


def has_targets(sample: TokenizedSample, token_budget: int) -> bool:
    """Whether the sample, truncated and with its first label masked, still has a token to learn from."""
    return any(label != IGNORE_INDEX for label in sample.labels[1:token_budget])


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


def pack_row(samples: Sequence[TokenizedSample], token_budget: int) -> dict[str, torch.Tensor]:
    """Concatenate (truncated) samples into one row of 1-D LongTensors: input_ids, labels, position_ids."""
    check_token_budget(token_budget)
    if not samples:
        raise ValueError("a row needs at least one sample")
    input_ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for sample in samples:
        n = min(len(sample), token_budget)
        input_ids.extend(sample.input_ids[:n])
        labels.append(IGNORE_INDEX)  # nobody's target: see the module docstring
        labels.extend(sample.labels[1:n])
        positions.extend(range(n))
    if len(input_ids) > token_budget:
        raise ValueError(f"the samples hold {len(input_ids)} tokens, more than the budget of {token_budget}")
    return {
        "input_ids": torch.tensor(input_ids, dtype=torch.long),
        "labels": torch.tensor(labels, dtype=torch.long),
        "position_ids": torch.tensor(positions, dtype=torch.long),
    }


def pack_samples(
    samples: Sequence[TokenizedSample], token_budget: int, open_rows: int = 16
) -> list[dict[str, torch.Tensor]]:
    """All samples, in the given order, packed into rows (``plan_rows`` then ``pack_row``)."""
    rows = plan_rows([len(s) for s in samples], token_budget, open_rows)
    return [pack_row([samples[i] for i in row], token_budget) for row in rows]
