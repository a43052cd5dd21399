"""Ulysses SP (gloo) against one process: loss, output and every parameter gradient within the rounding model
(``tests.tolerance``: the one-process run on kernels that sum in other orders as the witness).

The cases are every DiT spec's tiny config and variants (tests/dit/cases.py). All SP=2 cases run in one spawn and
the SP=4 ones in another (spawning a gloo world costs seconds). Every case has a token count that sp does not divide
(padding path); half the cases turn gradient checkpointing on (recomputed blocks repeat their all-to-alls in
backward: same gradients, no hang).
"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.dit.cases import CASES, inputs, loss_and_grads, shell
from tests.supports import has, require
from tests.tolerance import assert_within_rounding, references

# every spec's tiny case (and variant), with and without gradient checkpointing; SP=4 where 4 divides the heads; a
# spec whose class lacks SP is left out here and reported by test_every_spec_runs_at_sp_or_states_why
SP_NAMES = [name for name in sorted(CASES) if has(CASES[name].model_type, "sp")]
SP2 = [(name, checkpointing) for name in SP_NAMES for checkpointing in (False, True)]
SP4 = [(name, True) for name in SP_NAMES if CASES[name].config["num_attention_heads"] % 4 == 0]


def _run(name: str, checkpointing: bool) -> dict:
    case = CASES[name]
    model = shell(case)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    out, loss, grads = loss_and_grads(model, inputs(case))
    return {"out": out, "loss": loss, "grads": grads}


def sp_worker(rank: int, world_size: int, cases: list[tuple[str, bool]]) -> list[dict]:
    import torch.distributed as dist

    from runtime.parallel.state import init_parallel_state

    state = init_parallel_state(sp_size=world_size)
    results = []
    for name, checkpointing in cases:
        result = _run(name, checkpointing)
        for grad in result["grads"].values():  # partial gradients: the SP group's sum is the true gradient
            if grad is not None:
                dist.all_reduce(grad, group=state.sp_group)
        results.append(result)
    return results


def _compare(per_rank: list[list[dict]], cases: list[tuple], run=_run) -> None:
    """Every rank's result of each case against ``run(*case)`` in one process, under the rounding model (a gradient
    upstream leaves out of the loss is None on both sides)."""
    refs, witnesses = references(run, cases)
    for index, case in enumerate(cases):
        for got in (rank[index] for rank in per_rank):
            assert got["out"].shape == refs[index]["out"].shape, case
            assert_within_rounding(got, refs[index], witnesses[index], what=str(case))


@pytest.mark.parametrize("model_type", sorted({case.model_type for case in CASES.values()}))
def test_every_spec_runs_at_sp_or_states_why(model_type: str) -> None:
    require(model_type, "sp")


@pytest.mark.dist
def test_sp2_matches_single_process() -> None:
    _compare(run_distributed(sp_worker, 2, SP2, timeout=300), SP2)


@pytest.mark.dist
def test_sp4_matches_single_process() -> None:
    _compare(run_distributed(sp_worker, 4, SP4, timeout=300), SP4)
