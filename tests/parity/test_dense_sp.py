"""Ulysses SP=2 (two gloo ranks) against the single-process run: loss and every gradient within 1e-5 relative."""

from __future__ import annotations

import pytest

from runtime.models.registry import model_types, variant_cases, variant_overrides
from runtime.sp.ulysses import kv_repeat_factor
from tests.dist_utils import run_distributed
from tests.parity.dense import grads, models, packed_batch, relative_error, sp_worker
from tests.supports import require, supporting

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


def single_process(model_type: str, lengths: tuple[int, ...], config_kwargs: dict, _: dict) -> dict:
    _, model = models(model_type, **config_kwargs)
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
        ref = single_process(*case)
        for rank_results in per_rank:
            got = rank_results[index]
            assert relative_error(got["loss"], ref["loss"]) < 1e-5, case
            if got["logits"] is not None:
                assert relative_error(got["logits"], ref["logits"]) < 1e-5, case
            assert got["grads"].keys() == ref["grads"].keys()
            for name, grad in ref["grads"].items():
                assert relative_error(got["grads"][name], grad) < 1e-5, (case, name)


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
