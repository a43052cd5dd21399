"""The trainer's step gives a model that keeps packed documents apart only when told where they are (its record's
``data.packed_documents``: qwen3_next's gated delta-net recurrence) the row's boundaries; a model whose masks keep
them apart gets none unless its attention is flash's varlen path. The sp=2 and ring=2 trainer against one process:
tests/train/test_lm_structures_trainer.py; the start-up self-check's reference takes the same boundaries."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from runtime.data.sp_batch import packed_attention_kwargs
from runtime.models.registry import causal_lm_class
from runtime.models.tiny_configs import random_packed_batch, tiny_config, tiny_config_dict
from runtime.parallel.state import ParallelState, parallel_state
from runtime.train.config import parse_config
from runtime.train.text_step import needs_documents, text_forward_backward
from tests.tolerance import assert_within_rounding
from tests.train.common import run_config


class _Rows:
    def __init__(self, row: dict[str, torch.Tensor]) -> None:
        self.row = row

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.row

    def state_dict(self) -> dict:
        return {}


def _loss(model: torch.nn.Module, row: dict, tokens: torch.Tensor, documents: bool) -> dict:
    bounds = packed_attention_kwargs(row["position_ids"]) if documents else {}
    return {"loss": model(**row, **bounds, num_items_in_batch=tokens).loss.detach()}


def test_the_step_passes_the_rows_boundaries_to_a_model_that_needs_them(tmp_path: Path) -> None:
    """qwen3_next (load-balancing loss off): the step's loss is the model's given the row's boundaries, bitwise, and
    not the one without them (doc A's state carried into doc B)."""
    overrides = {"router_aux_loss_coef": 0.0}
    config = parse_config(
        run_config(tmp_path, model={"type": "qwen3_next", "config": {**tiny_config_dict("qwen3_next"), **overrides}})
    )
    assert needs_documents(config)
    torch.manual_seed(0)
    model = causal_lm_class("qwen3_next")(tiny_config("qwen3_next", **overrides))
    row = random_packed_batch((9, 7), 97)
    tokens = (row["labels"][:, 1:] != -100).sum()
    with parallel_state(ParallelState()):
        work = text_forward_backward(model, _Rows(row), ParallelState(), config)
        given, without = _loss(model, row, tokens, True), _loss(model, row, tokens, False)
        truth = _loss(copy.deepcopy(model).double(), row, tokens, True)
    assert torch.equal(work.loss, given["loss"])
    with pytest.raises(AssertionError, match="outside the rounding model"):
        assert_within_rounding(without, given, truth, what="the loss without the boundaries")


def test_a_model_whose_masks_keep_documents_apart_needs_none(tmp_path: Path) -> None:
    assert not needs_documents(parse_config(run_config(tmp_path)))
