"""gpt_oss keeps a packed row's documents apart under the trainer: upstream's forward builds its masks without the
position ids, so its mask alone lets every document attend to the ones before it; the trainer hands them over
(its record's ``[model.data] packed_documents = "position_ids"``). The last document of a packed row (earlier
documents' labels ignored) trains as that document alone, at sp=1, Ulysses sp=2 and ring=2; the start-up check
refuses a record that does not state it. Without the trainer's hand-over the generated class stays upstream's
(``tests/parity``: bitwise off, SP/ring against one process on the same leaky mask)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from runtime.models.tiny_configs import random_packed_batch, tiny_config_dict
from tests.dist_utils import run_distributed
from tests.parity.dense import grads
from tests.tolerance import assert_within_rounding
from tests.train.common import run_config

DOCUMENTS = (9, 7, 11)  # the last one is trained; the row (27 tokens) is SP-padded to 28 at sp=2
# no load-balancing loss: a statistic of the whole row, the documents' tokens together by design
OVERRIDES = {"router_aux_loss_coef": 0.0, "output_router_logits": False, "vocab_size": 97}


class _Rows:
    def __init__(self, row: dict[str, torch.Tensor]) -> None:
        self.row = row

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.row

    def state_dict(self) -> dict:
        return {}


def _rows() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the packed row, earlier documents' labels ignored; the last document alone)."""
    packed = random_packed_batch(DOCUMENTS, 97, seed=3)
    last = sum(DOCUMENTS[:-1])
    packed["labels"][:, :last] = -100
    alone = {k: v[:, last:].clone() for k, v in packed.items()}
    return packed, alone


def _raw(root: Path) -> dict:
    config = {**tiny_config_dict("gpt_oss"), **OVERRIDES}
    return run_config(root, model={"type": "gpt_oss", "config": config, "attn_implementation": "eager"})


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from runtime.models.registry import causal_lm_class
    from runtime.models.tiny_configs import tiny_config

    torch.manual_seed(0)
    return causal_lm_class("gpt_oss")(tiny_config("gpt_oss", experts_implementation="eager", **OVERRIDES)).to(dtype)


def _step(model: torch.nn.Module, row: dict, raw: dict, state) -> dict:
    """The trainer's step on ``row``: its loss and every parameter's gradient."""
    from runtime.train.config import parse_config
    from runtime.train.text_step import text_forward_backward

    work = text_forward_backward(model, _Rows(row), state, parse_config(raw))
    return {"loss": work.loss.detach(), "grads": grads(model)}


def _alone(raw: dict) -> tuple[dict, dict]:
    """The last document trained alone, one process: (fp32, the float64 truth)."""
    from runtime.parallel.state import ParallelState, parallel_state

    _, alone = _rows()
    with parallel_state(ParallelState()):
        return _step(_model(), alone, raw, ParallelState()), _step(_model(torch.float64), alone, raw, ParallelState())


def test_the_last_packed_document_trains_as_if_alone(tmp_path: Path) -> None:
    """sp=1: the step's loss and gradients on the packed row equal the document's alone, and so do its logits
    under the trainer's hand-over; the same row through the model as upstream builds its mask does not."""
    from runtime.parallel.state import ParallelState, parallel_state
    from runtime.train.config import parse_config
    from runtime.train.text_step import document_masks

    raw = _raw(tmp_path)
    packed, alone = _rows()
    ref, truth = _alone(raw)
    with parallel_state(ParallelState()):
        model = _model()
        got = _step(model, packed, raw, ParallelState())
        assert_within_rounding(got, ref, truth, what="gpt_oss: the packed row's last document against it alone")
        last = sum(DOCUMENTS[:-1])
        with torch.no_grad():
            ref_logits, truth_logits = _model()(**alone).logits, _model(torch.float64)(**alone).logits
            with document_masks(parse_config(raw)):
                logits = model(**packed).logits[:, last:]
            upstream = model(**packed).logits[:, last:]  # the mask upstream builds: the documents see each other
        assert_within_rounding({"logits": logits}, {"logits": ref_logits}, {"logits": truth_logits})
        with pytest.raises(AssertionError, match="outside the rounding model"):
            assert_within_rounding({"logits": upstream}, {"logits": ref_logits}, {"logits": truth_logits})
        leaky = copy.deepcopy(model)
        leaky.zero_grad(set_to_none=True)
        tokens = (packed["labels"][:, 1:] != -100).sum()
        leaky(**packed, num_items_in_batch=tokens).loss.backward()
        with pytest.raises(AssertionError, match="outside the rounding model"):
            assert_within_rounding({"grads": grads(leaky)}, {"grads": ref["grads"]}, {"grads": truth["grads"]})


def sp_worker(rank: int, world_size: int, raw: dict, layout: dict) -> dict:
    from runtime.parallel.fsdp import apply_fsdp
    from runtime.parallel.state import init_parallel_state

    state = init_parallel_state(**layout)
    model = _model()
    apply_fsdp(model, state)
    packed, _ = _rows()
    got = _step(model, packed, raw, state)
    return {"loss": got["loss"], "grads": {n.replace("_fsdp_wrapped_module.", ""): g for n, g in got["grads"].items()}}


@pytest.mark.dist
@pytest.mark.parametrize("layout", [{"sp_size": 2}, {"sp_size": 2, "ring_size": 2}], ids=["ulysses2", "ring2"])
def test_the_last_packed_document_trains_as_if_alone_under_sp(tmp_path: Path, layout: dict) -> None:
    """sp=2 (Ulysses, ring): every rank's loss and the gathered gradients equal the document's alone, one process."""
    raw = _raw(tmp_path)
    ref, truth = _alone(raw)
    for rank, got in enumerate(run_distributed(sp_worker, 2, raw, layout, timeout=300)):
        assert_within_rounding(got, ref, truth, what=f"gpt_oss {layout} rank {rank}: the last document alone")


def test_a_record_without_the_hand_over_is_refused() -> None:
    """The start-up check: gpt_oss's record without ``packed_documents`` is refused in one line naming the attention
    (its eager mask lets the documents see each other); the shipped record passes, and so does qwen3 (its mask
    builders read the position ids)."""
    import dataclasses

    from runtime.config.errors import ConfigError
    from runtime.models.registry import lookup
    from runtime.train.packed_documents import check_packed_documents
    from tests.train.self_check_defects import job_config

    shipped = lookup("gpt_oss")
    assert shipped.data["packed_documents"] == "position_ids"
    unstated = dataclasses.replace(shipped, data={k: v for k, v in shipped.data.items() if k != "packed_documents"})
    config = job_config("gpt_oss")
    config._attn_implementation = "eager"
    with pytest.raises(ConfigError) as refused:
        check_packed_documents(unstated, config)
    (message,) = refused.value.messages
    assert message == (
        "model.type: gpt_oss: model.layers.0.self_attn (GptOssAttention) lets one packed document attend to the "
        "others; state in spec 'gpt_oss' how its mask learns them ([model.data] packed_documents = \"position_ids\": "
        "the trainer hands the row's position ids to its mask builders)"
    ), message
    check_packed_documents(shipped, config)
    check_packed_documents(lookup("qwen3"), job_config("qwen3"))
