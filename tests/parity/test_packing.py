"""Packed sequences never attend across samples: a packed row equals its samples run one by one."""

from __future__ import annotations

import pytest

from runtime.models.registry import model_types
from tests.parity.dense import models, packed_batch, relative_error


@pytest.mark.parametrize("model_type", model_types("causal_lm", without="moe"))
def test_packed_row_equals_samples_run_separately(model_type: str) -> None:
    _, model = models(model_type)
    lengths = (6, 11, 4)
    batch = packed_batch(lengths)
    packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    start = 0
    for n in lengths:
        alone = model(input_ids=batch["input_ids"][:, start : start + n]).logits
        assert relative_error(packed[:, start : start + n], alone) < 1e-6, (n, start)
        start += n
    # and the packing really is what separates them: without position ids the row is one long sequence
    unpacked = model(input_ids=batch["input_ids"]).logits
    assert relative_error(unpacked[:, lengths[0] :], packed[:, lengths[0] :]) > 1e-3
