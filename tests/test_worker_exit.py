"""A pooled test rank (``tests/dist_utils``, also the ranks of ``bench/``) exits without nanobind's "leaked
instance" report: the pool freezes the collector's survivors after each call (``gc.freeze``), and a frozen object of
triton's IR (imported by ``torch._dynamo`` on every rank, though no kernel runs on CPU) read as a leak at exit,
27 lines per rank at the end of ``bench/train_overhead.py`` and of multi-rank pytest runs."""

from __future__ import annotations

import pickle

import pytest

from tests.dist_utils import _Pool


def _imports_dynamo(rank: int, world_size: int) -> bool:
    import sys

    import torch._dynamo  # noqa: F401  (what the runtime's ranks import: it imports triton when installed)

    return "triton" in sys.modules


@pytest.mark.dist
def test_a_pooled_rank_exits_without_leak_reports(capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("triton")  # the report comes from triton's nanobind extension
    pool = _Pool(1)  # a pool of its own, so the session's pools are left alone
    try:
        ok, failed, _ = pool.run(_imports_dynamo, (), timeout=120)
    finally:
        pool.close()  # the rank exits here; its stderr is this process's fd 2
    assert not failed and pickle.loads(ok[0]), failed  # the rank had triton loaded
    err = capfd.readouterr().err
    assert "leaked" not in err, err[:2000]
