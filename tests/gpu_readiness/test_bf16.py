"""bf16 numerics per family on CPU: bf16 autocast (fp32 parameters) and bf16 parameters against fp32, at SP=1 and SP=2.

The bounds are the measured errors (docs/performance.md, "bf16 numerics") with about 2x margin: relative error of
the loss, and of all parameter gradients taken as one vector (norm-wise). SP=2 in bf16 must stay within the same
bound against fp32 and against SP=1 in bf16: the Ulysses all-to-alls move bf16 values without rounding them again.
"""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.gpu_readiness.bf16 import FAMILIES, errors, run, sp_worker

BOUND = {"loss": 3e-4, "grad": 2.5e-2}
CASES = [(family, mode) for family in FAMILIES for mode in ("autocast", "bf16")]


@pytest.fixture(scope="module")
def results() -> dict:
    fp32 = {family: run(family, "fp32") for family in FAMILIES}
    sp1 = {case: run(*case) for case in CASES}
    sp2 = run_distributed(sp_worker, 2, CASES, timeout=600)
    return {"fp32": fp32, "sp1": sp1, "sp2": dict(zip(CASES, sp2[0], strict=True))}


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_bf16_within_bound(results: dict, case: tuple[str, str]) -> None:
    family, _ = case
    reference = results["fp32"][family]
    for what, got, ref in (
        ("sp=1 vs fp32", results["sp1"][case], reference),
        ("sp=2 vs fp32", results["sp2"][case], reference),
        ("sp=2 vs sp=1 in the same precision", results["sp2"][case], results["sp1"][case]),
    ):
        measured = errors(got, ref)
        for key, bound in BOUND.items():
            assert measured[key] < bound, (what, key, measured)
    # the bf16 runs differ from fp32 at all (a mode that silently ran in fp32 would pass any bound)
    assert errors(results["sp1"][case], reference)["grad"] > 1e-4
