"""The asynchronous Ulysses all-to-alls (``parallel.overlap``) give bitwise the results of the synchronous ones.

Each rank runs every case twice, overlap off then on, with the same weights and inputs: loss, output and every
parameter's partial gradient must be equal bit for bit (all-to-alls only move elements). The synchronous path is
itself held to the single process by tests/parity and tests/dit/test_sp.py. Cases: a packed dense LM with GQA, Wan
(self-attention) and Flux (joint attention with replicated text), each with gradient checkpointing on (recomputation
repeats the all-to-alls); at ulysses=2 and at ulysses=2 x ring=2 (the all-to-alls within the Ulysses group).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

LM_LENGTHS = (5, 9, 3)  # 17 tokens: the SP batch pads
DIT_CASES = ("wan", "flux")


def _lm(state) -> dict:
    from runtime.data.sp_batch import shard_for_sp
    from tests.parity.dense import grads, models, packed_batch

    _, model = models("qwen3")
    model.gradient_checkpointing_enable()
    model.train()
    out = model(**shard_for_sp(packed_batch(LM_LENGTHS), state))
    out.loss.backward()
    return {"out": out.logits.detach(), "loss": out.loss.detach(), "grads": grads(model)}


def _dit(name: str) -> dict:
    from tests.dit.cases import CASES, inputs, loss_and_grads, shell

    case = CASES[name]
    model = shell(case)
    model.gradient_checkpointing_enable()
    model.train()
    out, loss, grads = loss_and_grads(model, inputs(case))
    return {"out": out, "loss": loss, "grads": grads}


def _differences(off: dict, on: dict) -> list[str]:
    bad = [k for k in ("out", "loss") if not torch.equal(off[k], on[k])]
    bad += [n for n, g in off["grads"].items() if (g is None) != (on["grads"][n] is None)]
    bad += [n for n, g in off["grads"].items() if g is not None and not torch.equal(g, on["grads"][n])]
    return bad


def _engaged(group) -> bool:
    """The switch really selects the asynchronous function (else the parity below would compare a path to itself)."""
    from runtime.sp.overlap import overlap, seq_to_heads

    x = torch.randn(1, 4, 3, 2, requires_grad=True)
    with overlap(True):
        (on,) = seq_to_heads([x], seq_dim=2, head_dim=1, group=group)
    with overlap(False):
        (off,) = seq_to_heads([x], seq_dim=2, head_dim=1, group=group)
    return type(on.grad_fn).__name__ == "_AllToAllManyBackward" and type(off.grad_fn).__name__ == "_AllToAllBackward"


def overlap_worker(rank: int, world_size: int, ring: int) -> dict[str, list[str]]:
    from runtime.parallel.state import init_parallel_state
    from runtime.sp.overlap import overlap

    state = init_parallel_state(sp_size=world_size, ring_size=ring)
    runs = {"qwen3": lambda: _lm(state), **{name: (lambda name=name: _dit(name)) for name in DIT_CASES}}
    result = {"engaged": _engaged(state.ulysses_group)}
    for name, run in runs.items():
        with overlap(False):
            off = run()
        with overlap(True):
            on = run()
        assert off["grads"], name
        result[name] = _differences(off, on)
    return result


@pytest.mark.dist
@pytest.mark.parametrize("world, ring", [(2, 1), (4, 2)], ids=["ulysses2", "ulysses2_ring2"])
def test_overlap_is_bitwise_equal_to_synchronous(world: int, ring: int) -> None:
    for rank, result in enumerate(run_distributed(overlap_worker, world, ring, timeout=300)):
        assert result == {"engaged": True, "qwen3": [], **{name: [] for name in DIT_CASES}}, rank
