"""FSDP dummy forward of the vision tower: under FSDP2 (2 gloo ranks) rank 0 trains on a row with two images and
rank 1 on a text-only row. Without the dummy forward rank 1 would skip the vision blocks' all-gathers and the job
would hang; with it both ranks run the same vision calls, and the summed gradients equal the single-process
gradients of the two rows' global token-weighted loss within 1e-5 (the vision tower's gradient comes from rank 0's
images only: the dummy adds an exact zero)."""

from __future__ import annotations

import pytest
import torch

from runtime.models.registry import model_types
from tests.dist_utils import run_distributed
from tests.parity.dense import grads
from tests.parity.vlm import vlm_batch, vlm_models
from tests.tolerance import assert_within_rounding

MODELS = model_types("vlm", without="moe")


def rows(model_type: str) -> list[dict[str, torch.Tensor]]:
    with_images = vlm_batch(model_type)
    text_only = vlm_batch(model_type, grids=(), text=(19,), seed=3)
    assert "pixel_values" not in text_only
    return [with_images, text_only]


def target_count(batch_rows: list[dict[str, torch.Tensor]]) -> int:
    return sum(int((r["labels"][:, 1:] != -100).sum()) for r in batch_rows)


def fsdp_worker(rank: int, world: int, model_type: str) -> dict:
    from runtime.parallel.fsdp import apply_fsdp
    from runtime.parallel.state import init_parallel_state

    state = init_parallel_state(dp_shard_size=world)
    _, model = vlm_models(model_type)
    vision_calls = []
    model.model.visual.blocks[0].register_forward_hook(lambda *_: vision_calls.append(1))
    apply_fsdp(model, state)
    batch_rows = rows(model_type)
    out = model(**batch_rows[rank], num_items_in_batch=target_count(batch_rows))
    out.loss.backward()
    full = {n.replace("_fsdp_wrapped_module.", ""): p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"vision_calls": len(vision_calls), "grads": full if rank == 0 else None}


@pytest.mark.dist
@pytest.mark.parametrize("model_type", MODELS)
def test_rank_without_images_runs_the_vision_tower(model_type: str) -> None:
    results = run_distributed(fsdp_worker, 2, model_type, timeout=300)
    # images or a dummy, then videos or a dummy: the same vision calls on both ranks
    assert [r["vision_calls"] for r in results] == [2, 2]

    ref, truth = _one_process(model_type, torch.float32), _one_process(model_type, torch.float64)
    assert any(n.startswith("model.visual.") for n in ref)
    # within the rounding model (tests.tolerance), the float64 run the truth
    assert_within_rounding({"grads": results[0]["grads"]}, {"grads": ref}, {"grads": truth}, what=model_type)


def _one_process(model_type: str, dtype: torch.dtype) -> dict:
    """Every row's loss in one process, summed, and its gradients."""
    _, model = vlm_models(model_type)
    model.to(dtype)
    batch_rows = [{k: _cast(v, dtype) for k, v in r.items()} for r in rows(model_type)]
    loss = sum(model(**row, num_items_in_batch=target_count(batch_rows)).loss for row in batch_rows)
    loss.backward()
    return grads(model)


def _cast(value, dtype: torch.dtype):
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
