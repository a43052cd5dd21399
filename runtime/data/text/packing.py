"""Pack tokenized text samples into rows of at most ``token_budget`` tokens, and the text trainer's loader.

A row is the concatenation of whole samples. Its ``position_ids`` restart at 0 for every sample, which is what the
generated models use to build the packing mask (no attention across samples) and RoPE. Labels stay unshifted, but
the label of each sample's first token is set to ``IGNORE_INDEX``: the SP loss shifts labels over the whole row
(``target[t] = labels[t + 1]``), so without this the last token of one sample would be trained to predict the first
token of the next one.

Samples longer than the budget are **truncated** to their first ``token_budget`` tokens rather than split: a
continuation piece would restart its position ids mid-document without the context it depends on, and for chat it
would be a conversation cut in half. The data reader (``split_documents``) keeps plain-text documents short instead.

Which samples share a row, and which rank trains on it, is the loader of every token
model (``runtime/data/loader.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.data.loader import PackedLoader, check_token_budget
from runtime.data.sp_batch import IGNORE_INDEX
from runtime.data.text.tokenization import TokenizedSample


def has_targets(sample: TokenizedSample, token_budget: int) -> bool:
    """Whether the sample, truncated and with its first label masked, still has a token to learn from."""
    return any(label != IGNORE_INDEX for label in sample.labels[1:token_budget])


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


class TextPackedLoader(PackedLoader):
    """Yields ``{"input_ids", "labels", "position_ids"}``, each a LongTensor of shape ``(1, L)`` with ``L <= budget``;
    keeps the samples with a target within the budget (``has_targets``), truncates the longer ones."""

    requirement = "has a training target within"

    def keeps(self, sample: TokenizedSample) -> bool:
        return has_targets(sample, self.token_budget)

    def pack(self, samples: Sequence[TokenizedSample]) -> dict[str, torch.Tensor]:
        row = pack_row(samples, self.token_budget)
        return {k: v.unsqueeze(0) for k, v in row.items()}
