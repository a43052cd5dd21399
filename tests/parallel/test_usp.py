"""Ring and Ulysses x ring (USP) attention in the generated LMs against the single-process run: loss, logits and
every parameter gradient within 1e-5 relative (fp32, gloo), with the dense parity machinery (tests/parity/dense.py).

Packed rows whose documents straddle the chunk edges, an odd total (the SP padding segment), gradient checkpointing
on. SP 4 on a 2-head model is past the head count: ring 4, and Ulysses 2 x ring 2.
"""

from __future__ import annotations

import pytest
import torch

from runtime.sp.usp import document_ids
from tests.dist_utils import run_distributed
from tests.omni.omni import assert_grad_close
from tests.omni.test_omni_sp import rows as omni_rows
from tests.omni.test_omni_sp import single_process as omni_single_process
from tests.omni.test_omni_sp import sp_worker as omni_sp_worker
from tests.parity.dense import relative_error, sp_worker
from tests.parity.test_dense_sp import single_process
from tests.parity.test_vlm_sp import CASES as VLM_CASES
from tests.parity.test_vlm_sp import VIDEO_CASE, sp_vlm_worker
from tests.parity.test_vlm_sp import single_process as vlm_single_process

TWO_HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1}
# (world, ring): the cases run there
LAYOUTS = {
    "ring2": (2, 2, [("qwen3", (7, 10, 6), {}, {})]),
    "ring4_2heads": (4, 4, [("qwen3", (9, 4, 10), TWO_HEADS, {})]),
    "ulysses2_ring2_2heads": (4, 2, [("qwen3", (5, 12, 6), TWO_HEADS, {})]),
}


def _check(per_rank: list[list[dict]], cases: list) -> None:
    for index, case in enumerate(cases):
        ref = single_process(*case)
        for rank_results in per_rank:
            got = rank_results[index]
            assert relative_error(got["loss"], ref["loss"]) < 1e-5, case
            assert relative_error(got["logits"], ref["logits"]) < 1e-5, case
            assert got["grads"].keys() == ref["grads"].keys()
            for name, grad in ref["grads"].items():
                assert relative_error(got["grads"][name], grad) < 1e-5, (case, name)


@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_usp_dense_matches_single_process(layout: str) -> None:
    world, ring, cases = LAYOUTS[layout]
    _check(run_distributed(sp_worker, world, cases, ring, True, timeout=300), cases)


@pytest.mark.dist
@pytest.mark.parametrize("model_type", ["qwen3_vl"])
def test_usp_vlm_matches_single_process(model_type: str) -> None:
    """The language model on ring 2; the ViT stays on Ulysses over the whole SP group (its heads split by sp)."""
    per_rank = run_distributed(sp_vlm_worker, 2, model_type, 2, timeout=300)
    for index, case in enumerate([*VLM_CASES, VIDEO_CASE]):
        ref = vlm_single_process(model_type, *case)
        for rank_results in per_rank:
            got = rank_results[index]
            assert relative_error(got["loss"], ref["loss"]) < 1e-5, case
            assert relative_error(got["logits"], ref["logits"]) < 1e-5, case
            assert got["grads"].keys() == ref["grads"].keys()
            for name, grad in ref["grads"].items():
                assert relative_error(got["grads"][name], grad) < 1e-5, (case, name)


@pytest.mark.dist
def test_usp_omni_thinker_matches_single_process() -> None:
    """The qwen3_omni_moe thinker's LM on ring 2 (audio, images, a video with audio spread over both ranks)."""
    per_rank = run_distributed(omni_sp_worker, 2, 2, ("spread",), timeout=300)
    ref = omni_single_process(omni_rows()["spread"], 2)
    for rank_results in per_rank:
        got = rank_results["spread"]
        for key in ("loss", "aux", "logits"):
            assert relative_error(got[key], ref[key]) < 1e-5, key
        assert got["grads"].keys() == ref["grads"].keys()
        for key, grad in ref["grads"].items():
            assert_grad_close(got["grads"][key], grad, key, "spread")


def test_document_ids_follow_position_restarts():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    assert document_ids(positions).tolist() == [[1, 1, 1, 2, 2, 3, 4, 4, 4, 4]]
