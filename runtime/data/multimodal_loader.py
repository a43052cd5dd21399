"""The VLM trainer's data loader: ``PackedLoader`` over tokenized multimodal samples.

Same order, DP sharding, equal step counts and resume semantics (``PackedRowSampler``); only what is kept and how a
row is built differ: samples longer than the budget are dropped rather than truncated (counted in ``num_dropped``
with the samples that have no target), and rows come from ``pack_multimodal_row``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.data.loader import PackedLoader
from runtime.data.multimodal import MultimodalSample
from runtime.data.multimodal_packing import has_multimodal_targets, pack_multimodal_row


class MultimodalPackedLoader(PackedLoader):
    """Yields ``pack_multimodal_row`` batches: token tensors ``(1, L)``, position_ids ``(4, 1, L)``, vision tensors.

    Constructor, ``for_parallel_state``, iteration and ``state_dict`` / ``load_state_dict`` are ``PackedLoader``'s.
    """

    requirement = "fits whole and has a training target within"

    def keeps(self, sample: MultimodalSample) -> bool:
        return has_multimodal_targets(sample, self.token_budget)

    def pack(self, samples: Sequence[MultimodalSample]) -> dict[str, torch.Tensor]:
        return pack_multimodal_row(samples, self.token_budget)
