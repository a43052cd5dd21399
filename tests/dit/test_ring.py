"""DiT context parallelism past the head count against one process: loss, output and every parameter gradient within
1e-5 relative (tests/dit/test_sp.py's comparison), gradient checkpointing on.

* ring=2 (world 2): every DiT spec's tiny case, not its variants (self-attention, replicated text first or last, a
  key mask, no RoPE, (b, h, s, d)): the replicated text is attended once per query while only the image K/V are
  gathered over the ring;
* ring=4 and ulysses=2 x ring=2 (world 4): Wan and Flux, plus Wan with 2 heads, where SP=4 is twice the head count.

Every token count is indivisible by 2 and 4, so the last ring rank's queries hold padding the gathered keys must not
show.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.dist_utils import run_distributed
from tests.dit.cases import CASES, inputs, loss_and_grads, shell
from tests.dit.test_sp import _compare

RING2 = [(name, None) for name in sorted(CASES) if CASES[name].variant is None]  # one case per DiT spec
WORLD4 = [("wan", None), ("flux", None), ("wan", 2)]


def _run(name: str, heads: int | None) -> dict:
    case = CASES[name]
    if heads is not None:
        case = dataclasses.replace(case, config={**case.config, "num_attention_heads": heads})
    model = shell(case)
    model.gradient_checkpointing_enable()
    model.train()
    out, loss, grads = loss_and_grads(model, inputs(case))
    return {"out": out, "loss": loss, "grads": grads}


def ring_worker(rank: int, world_size: int, ring: int, cases: list[tuple[str, int | None]]) -> list[dict]:
    import torch.distributed as dist

    from runtime.parallel.state import init_parallel_state

    state = init_parallel_state(sp_size=world_size, ring_size=ring)
    assert state.ring_size == ring and state.ulysses_size == world_size // ring
    results = []
    for case in cases:
        result = _run(*case)
        for grad in result["grads"].values():  # partial gradients: the SP group's sum is the true gradient
            if grad is not None:
                dist.all_reduce(grad, group=state.sp_group)
        results.append(result)
    return results


@pytest.mark.dist
def test_ring2_matches_single_process() -> None:
    _compare(run_distributed(ring_worker, 2, 2, RING2, timeout=300), RING2, run=_run)


@pytest.mark.dist
@pytest.mark.parametrize("ring", [4, 2], ids=["ring4", "ulysses2_ring2"])
def test_sp4_past_the_heads_matches_single_process(ring: int) -> None:
    _compare(run_distributed(ring_worker, 4, ring, WORLD4, timeout=300), WORLD4, run=_run)
