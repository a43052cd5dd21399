"""Ulysses SP=2 (two gloo ranks) against the single-process run: loss, logits and every gradient within the rounding
model (``tests.tolerance``: the single process's own float32 error against the same run in float64 as the noise)."""

from __future__ import annotations

import pytest
import torch

from runtime.models.registry import model_types, variant_cases, variant_overrides
from runtime.sp.ulysses import kv_repeat_factor
from tests.dist_utils import run_distributed
from tests.parity.dense import grads, models, packed_batch, sp_worker
from tests.supports import require, supporting
from tests.tolerance import assert_within_rounding

# Every dense causal LM of the specs on a packed row whose sequence lengths are not multiples of 2 (odd total too);
# then every tiny variant (the config-gated branches the tiny configs do not reach); then, on the first ones, a
# 1-KV-head case (sp > kv heads) and the loss computed chunk-wise from hidden states. A model whose class lacks SP is
# left out here and reported by test_every_dense_lm_runs_at_sp_or_states_why.
DENSE = supporting(model_types("causal_lm", without="moe"), "sp")
CASES = [
    *((model_type, (7, 10) if index % 2 == 0 else (5, 9, 3), {}, {}) for index, model_type in enumerate(DENSE)),
    *((t, (9, 6, 4), variant_overrides(t, v), {}) for t, v in variant_cases(DENSE) if v is not None),
    (DENSE[0], (11, 6), {"num_key_value_heads": 1}, {}),
    (DENSE[-1], (8, 5, 4), {}, {"loss_chunk_size": 3}),
]


def single_process(
    model_type: str, lengths: tuple[int, ...], config_kwargs: dict, _: dict, dtype: torch.dtype = torch.float32
) -> dict:
    """The case in one process; ``dtype=torch.float64``: the same weights and batch in float64, the truth the
    rounding model measures the float32 run against."""
    _, model = models(model_type, **config_kwargs)
    model.to(dtype)
    out = model(**packed_batch(lengths))
    out.loss.backward()
    return {"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": grads(model)}


@pytest.mark.parametrize("model_type", model_types("causal_lm", without="moe"))
def test_every_dense_lm_runs_at_sp_or_states_why(model_type: str) -> None:
    require(model_type, "sp")


@pytest.mark.dist
def test_sp2_matches_single_process() -> None:
    per_rank = run_distributed(sp_worker, 2, CASES, timeout=300)
    for index, case in enumerate(CASES):
        ref, truth = single_process(*case), single_process(*case, dtype=torch.float64)
        for rank_results in per_rank:
            got = rank_results[index]
            keys = ["loss", "grads"] + (["logits"] if got["logits"] is not None else [])
            assert_within_rounding(got, ref, truth, keys, what=str(case))


def test_kv_heads_repeat_only_when_needed() -> None:
    assert kv_repeat_factor(8, 4, 2) == 1
    assert kv_repeat_factor(8, 2, 4) == 2
    assert kv_repeat_factor(8, 1, 4) == 4


@pytest.mark.parametrize(
    ("heads", "kv", "sp", "message"),
    [
        (6, 2, 4, "6 attention heads cannot be split over sp=4"),
        (12, 3, 2, "3 key/value heads cannot be split over sp=2"),
    ],
)
def test_heads_that_cannot_be_split_are_refused(heads: int, kv: int, sp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kv_repeat_factor(heads, kv, sp)
