"""Ring and Ulysses x ring (USP) attention in the generated LMs against the single-process run: loss, logits and
every parameter gradient within the rounding model (``tests.tolerance``; fp32, gloo, the float64 run the truth), with
the dense parity machinery (tests/parity/dense.py).

Packed rows whose documents straddle the chunk edges, an odd total (the SP padding segment), gradient checkpointing
on. SP 4 on a 2-head model is past the head count: ring 4, and Ulysses 2 x ring 2.
"""

from __future__ import annotations

import pytest
import torch

from runtime.sp.usp import document_ids
from tests.dist_utils import run_distributed
from tests.omni.test_omni_sp import rows as omni_rows
from tests.omni.test_omni_sp import single_process as omni_single_process
from tests.omni.test_omni_sp import sp_worker as omni_sp_worker
from tests.parity.dense import sp_worker
from tests.parity.test_dense_sp import single_process
from tests.parity.test_vlm_sp import CASES as VLM_CASES
from tests.parity.test_vlm_sp import VIDEO_CASE, sp_vlm_worker
from tests.parity.test_vlm_sp import single_process as vlm_single_process
from tests.supports import require
from tests.tolerance import assert_within_rounding

TWO_HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1}
# (world, ring): the cases run there
LAYOUTS = {
    "ring2": (2, 2, [("qwen3", (7, 10, 6), {}, {})]),
    "ring4_2heads": (4, 4, [("qwen3", (9, 4, 10), TWO_HEADS, {})]),
    "ulysses2_ring2_2heads": (4, 2, [("qwen3", (5, 12, 6), TWO_HEADS, {})]),
}


def _check(per_rank: list[list[dict]], cases: list, reference=single_process) -> None:
    """Every rank's loss, logits and every gradient of each case within the rounding model of the one-process
    ``reference`` (its float64 run the truth: ``reference(*case, dtype=torch.float64)``)."""
    for index, case in enumerate(cases):
        ref, truth = reference(*case), reference(*case, dtype=torch.float64)
        for rank_results in per_rank:
            assert_within_rounding(rank_results[index], ref, truth, ["loss", "logits", "grads"], what=str(case))


@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_usp_dense_matches_single_process(layout: str) -> None:
    world, ring, cases = LAYOUTS[layout]
    for model_type, *_ in cases:
        require(model_type, "ring")
    _check(run_distributed(sp_worker, world, cases, ring, True, timeout=300), cases)


@pytest.mark.dist
@pytest.mark.parametrize(
    "model_type, world, ring",
    [("qwen3_vl", 2, 2), ("qwen3_vl", 4, 2), ("qwen3_vl", 4, 4)],
    ids=["ring2", "ulysses2_ring2", "ring4"],
)
def test_usp_vlm_matches_single_process(model_type: str, world: int, ring: int) -> None:
    """The language model on the ring (world 4: Ulysses 2 x ring 2, or ring 4); the ViT stays on Ulysses over the
    whole SP group (its heads split by sp)."""
    require(model_type, "ring")
    per_rank = run_distributed(sp_vlm_worker, world, model_type, ring, timeout=300)
    _check(per_rank, [*VLM_CASES, VIDEO_CASE], lambda *case, **dtype: vlm_single_process(model_type, *case, **dtype))


@pytest.mark.dist
def test_usp_omni_thinker_matches_single_process() -> None:
    """The qwen3_omni_moe thinker's LM on ring 2 (audio, images, a video with audio spread over both ranks)."""
    require("qwen3_omni_moe_thinker", "ring")
    per_rank = run_distributed(omni_sp_worker, 2, 2, ("spread",), timeout=300)
    row = omni_rows()["spread"]
    ref, truth = omni_single_process(row, 4), omni_single_process(row, 4, torch.float64)  # padded as under a ring
    for rank_results in per_rank:
        assert_within_rounding(rank_results["spread"], ref, truth, ["loss", "aux", "logits", "grads"], what="spread")


def test_document_ids_follow_position_restarts():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    assert document_ids(positions).tolist() == [[1, 1, 1, 2, 2, 3, 4, 4, 4, 4]]


@pytest.mark.parametrize("sp, ring", [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_layout_covers_the_row_once_and_balances_the_ring(sp: int, ring: int) -> None:
    from runtime.data.sp_batch import shard_row
    from runtime.sp.layout import gathered_order, pad_multiple, rank_token_index, to_natural_order, zigzag_indices

    length = 48
    order = gathered_order(length, sp, ring)
    assert sorted(order.tolist()) == list(range(length))
    ulysses = sp // ring
    for r in range(ring):  # what the Ulysses all-to-all of ring rank r assembles is its zigzag pair of chunks
        pieces = [rank_token_index(length, sp, ring, r * ulysses + j) for j in range(ulysses)]
        expected = zigzag_indices(length, ring, r) if ring > 1 else torch.arange(length)
        assert torch.equal(torch.cat(pieces), expected)
    row = torch.arange(100, 100 + length)[None]
    assert torch.equal(to_natural_order(row[:, order], 1, sp, ring), row)
    # shard_row pads to sp (2 x sp under a ring) with a padding segment and indexes the same way
    padded = 45 + -45 % pad_multiple(sp, ring)
    batch = {"input_ids": row[:, :45], "labels": row[:, :45], "position_ids": torch.arange(45)[None]}
    got = [shard_row(batch, sp, k, ring) for k in range(sp)]
    ids = to_natural_order(torch.cat([g["input_ids"] for g in got], 1), 1, sp, ring)
    assert torch.equal(ids[:, :45], row[:, :45]) and ids.shape[1] == padded == (46 if (sp, ring) == (2, 1) else 48)
    mask = to_natural_order(torch.cat([g["token_mask"] for g in got], 1), 1, sp, ring)
    assert mask[0].tolist() == [True] * 45 + [False] * (padded - 45)
