"""DiT context parallelism past the head count: ring=2 (world 2) and ulysses=2 x ring=2 (world 4) against one
process, loss, output and every parameter gradient within 1e-5 relative (tests/dit/test_sp.py's comparison).

Wan (self-attention) and Flux (joint attention: the replicated text is attended once per query while the image K/V
are gathered over the ring) with gradient checkpointing on; their token counts are not divisible by 2 or 4, so the
last ring rank's queries hold padding that the gathered keys must not show. SP=4 on 4-head models is one case of
the head limit: ulysses=2 x ring=2 splits the heads only 2 ways.
"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.dit.test_sp import _compare, _run

CASES = [("wan", True), ("flux", True)]


def ring_worker(rank: int, world_size: int, ring: int, cases: list[tuple[str, bool]]) -> list[dict]:
    import torch.distributed as dist

    from runtime.parallel.state import init_parallel_state

    state = init_parallel_state(sp_size=world_size, ring_size=ring)
    assert state.ring_size == ring and state.ulysses_size == world_size // ring
    results = []
    for name, checkpointing in cases:
        result = _run(name, checkpointing)
        for grad in result["grads"].values():  # partial gradients: the SP group's sum is the true gradient
            if grad is not None:
                dist.all_reduce(grad, group=state.sp_group)
        results.append(result)
    return results


@pytest.mark.dist
def test_ring2_matches_single_process() -> None:
    _compare(run_distributed(ring_worker, 2, 2, CASES, timeout=300), CASES)


@pytest.mark.dist
def test_ulysses2_ring2_matches_single_process() -> None:
    _compare(run_distributed(ring_worker, 4, 2, CASES, timeout=300), CASES)
