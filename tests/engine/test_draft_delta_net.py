"""A gated delta-net model the project does not ship (Qwen3.5-MoE's text model), drafted with no hand edit and
generated into a scratch package (``tests.engine.drafted``): equal to upstream bit for bit with parallelism off, and
under SP (Ulysses, a ring) with packed documents within the rounding model of one process: the proof that draft's
linear-attention recogniser splits an unseen model's layers as the shipped Qwen3-Next spec does. About 25 s, most of
it starting the two ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.engine.drafted import DraftedModel, drafted_installed, generate_drafted
from tests.parity.dense import gathered_like_one_process, grads, models, packed_batch
from tests.tolerance import assert_within_rounding

MODEL = "qwen3_5_moe_text"
LENGTHS = (9, 7)  # two packed documents; an odd row: SP pads it with a segment of its own
CASES = [(2, 1), (2, 2)]  # (sp, ring) at world size 2: Ulysses, a ring


def _run(model: torch.nn.Module, batch: dict) -> dict:
    """Loss, logits and every gradient on a packed row, its document boundaries passed (what the trainer does for a
    record with ``packed_documents = "cu_seq_lens"``)."""
    from runtime.data.sp_batch import packed_attention_kwargs

    out = model(**batch, **packed_attention_kwargs(batch["position_ids"]))
    out.loss.backward()
    return {"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": grads(model)}


def sp_worker(rank: int, world: int, root: str, drafted: DraftedModel) -> list[dict]:
    """Each case: the row sharded, the logits gathered in the row's order, the gradients summed over the group."""

    from runtime.data.sp_batch import shard_for_sp
    from runtime.parallel.state import init_parallel_state, set_parallel_state

    results = []
    with drafted_installed(Path(root), [drafted]):
        for sp, ring in CASES:
            state = init_parallel_state(sp_size=sp, ring_size=ring)
            _, model = models(MODEL)
            got = _run(model, shard_for_sp(packed_batch(LENGTHS), state))
            results.append(gathered_like_one_process(got, state, sum(LENGTHS)))
            set_parallel_state(None)
    return results


@pytest.mark.dist
def test_a_drafted_delta_net_is_upstream_off_and_one_process_under_sp(tmp_path: Path) -> None:
    drafted = generate_drafted(MODEL, tmp_path)
    with drafted_installed(tmp_path, [drafted]):
        upstream, generated_model = models(MODEL)
        assert type(generated_model).__module__ == drafted.module
        batch = packed_batch(LENGTHS)
        outputs = [m(**batch) for m in (upstream, generated_model)]
        assert torch.equal(outputs[0].logits, outputs[1].logits) and torch.equal(outputs[0].loss, outputs[1].loss)
        for out in outputs:
            out.loss.backward()
        ref_grads, got_grads = grads(upstream), grads(generated_model)
        assert ref_grads.keys() == got_grads.keys() and len(ref_grads) > 10
        assert all(torch.equal(ref_grads[k], got_grads[k]) for k in ref_grads)
        ref = _run(models(MODEL)[1], packed_batch(LENGTHS))
        truth = _run(models(MODEL)[1].double(), packed_batch(LENGTHS))
    per_rank = run_distributed(sp_worker, 2, str(tmp_path), drafted, timeout=300)
    for rank, results in enumerate(per_rank):
        for (sp, ring), got in zip(CASES, results, strict=True):
            assert_within_rounding(got, ref, truth, what=f"drafted {MODEL} sp {sp} ring {ring} rank {rank}")
