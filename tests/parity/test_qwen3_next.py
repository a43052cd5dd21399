"""Qwen3-Next's gated delta-net layers on packed rows: given the row's document boundaries (``cu_seq_lens_q``, what
the trainer passes) the convolution and the recurrence restart at each document, in one process and under SP
(Ulysses, a ring, both) alike; an SP size that does not divide the layer's value heads is refused in one line.
Parallelism off without boundaries (upstream's own call) and the MoE layouts are the shared suites'
(test_dense_off, test_moe_parallel); each comparison here is within the rounding model (``tests.tolerance``)."""

from __future__ import annotations

import copy

import pytest
import torch

from runtime.data.sp_batch import packed_attention_kwargs
from tests.dist_utils import run_distributed
from tests.parity.dense import gathered_like_one_process, grads, models, packed_batch
from tests.tolerance import assert_within_rounding

MODEL = "qwen3_next"
LENGTHS = (9, 7)  # doc A, doc B; odd total: SP pads the row with a segment of its own


def _run(model: torch.nn.Module, batch: dict, documents: bool, keep: slice = slice(None)) -> dict:
    """Loss, the logits of the tokens ``keep`` and every gradient of ``model`` on ``batch`` (with its document
    boundaries when ``documents``)."""
    extra = packed_attention_kwargs(batch["position_ids"]) if documents else {}
    out = model(**batch, **extra)
    out.loss.backward()
    return {"loss": out.loss.detach(), "logits": out.logits.detach()[:, keep], "grads": grads(model)}


def _doc_b_alone_and_packed(documents: bool) -> tuple[dict, dict, dict]:
    """Doc B alone (float32 and the float64 truth) and packed after doc A, whose tokens are nobody's target; the
    load-balancing loss off (a statistic of every token of the row, doc A's too)."""
    _, model = models(MODEL, output_router_logits=False)
    truth_model = copy.deepcopy(model).double()
    row = packed_batch(LENGTHS)
    row["labels"][:, : LENGTHS[0]] = -100
    alone = {k: v[:, LENGTHS[0] :] for k, v in row.items()}
    truth = _run(truth_model, alone, documents=False)
    ref = _run(model, alone, documents=False)
    model.zero_grad(set_to_none=True)
    packed = _run(model, row, documents, keep=slice(LENGTHS[0], None))
    return packed, ref, truth


def test_doc_b_packed_equals_doc_b_alone_given_the_boundaries() -> None:
    """Through the delta-net: the logits, the loss and every gradient of doc B packed after doc A are doc B's alone."""
    assert_within_rounding(*_doc_b_alone_and_packed(documents=True), what="doc B packed, boundaries given")


def test_without_the_boundaries_the_delta_net_carries_doc_a_into_doc_b() -> None:
    """Upstream's torch path (and ours without boundaries): the recurrence's state crosses the document boundary, so
    the comparison above fails (the test can fail); the softmax layers alone would keep the documents apart."""
    with pytest.raises(AssertionError, match="outside the rounding model"):
        assert_within_rounding(*_doc_b_alone_and_packed(documents=False), what="doc B packed, no boundaries")


# (tiny-config overrides, SP size, ring size): Ulysses, a ring, both; q/k repeated (2 key heads, 4 value heads) and not
CASES = [
    ({}, 2, 1),
    ({}, 2, 2),
    ({"linear_num_key_heads": 4, "linear_num_value_heads": 4}, 2, 1),
    ({}, 4, 1),
    ({}, 4, 2),
]


def single_process(overrides: dict, dtype: torch.dtype = torch.float32) -> dict:
    _, model = models(MODEL, **overrides)
    return _run(model.to(dtype), packed_batch(LENGTHS), documents=True)


def sp_worker(rank: int, world: int, cases: list[tuple[dict, int, int]]) -> list[dict | str]:
    """Each case of this world size: the padded row's boundaries passed, logits gathered in the row's order, the
    gradients summed over the SP group (each rank's are partial); a refused layout's one-line message."""

    from runtime.config.errors import LayoutRefused
    from runtime.data.sp_batch import shard_for_sp
    from runtime.parallel.state import init_parallel_state, set_parallel_state

    results: list[dict | str] = []
    for overrides, sp, ring in cases:
        state = init_parallel_state(sp_size=sp, ring_size=ring)
        _, model = models(MODEL, **overrides)
        try:
            got = _run(model, shard_for_sp(packed_batch(LENGTHS), state), documents=True)
        except LayoutRefused as refused:
            results.append(str(refused))
            set_parallel_state(None)
            continue
        results.append(gathered_like_one_process(got, state, sum(LENGTHS)))
        set_parallel_state(None)
    return results


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_sp_with_documents_matches_single_process(world: int) -> None:
    cases = [case for case in CASES if case[1] == world]
    per_rank = run_distributed(sp_worker, world, cases, timeout=300)
    for index, (overrides, sp, ring) in enumerate(cases):
        ref, truth = single_process(overrides), single_process(overrides, torch.float64)
        for rank, results in enumerate(per_rank):
            what = f"{MODEL} {overrides} sp {sp} ring {ring} rank {rank}"
            assert_within_rounding(results[index], ref, truth, what=what)


@pytest.mark.dist
def test_sp_not_dividing_the_value_heads_is_refused() -> None:
    """sp = 4 over 2 value heads (the 32 conv channels split): one line naming the layer and what to choose."""
    refused = {"linear_num_key_heads": 1, "linear_num_value_heads": 2}
    messages = run_distributed(sp_worker, 4, [(refused, 4, 1)], timeout=300)
    for [message] in messages:
        assert message == (
            "parallel.sp: 4 does not divide the 2 value heads of Qwen3NextGatedDeltaNet (linear attention runs "
            "Ulysses over the whole SP group, ring included): choose an SP size dividing 2"
        )
