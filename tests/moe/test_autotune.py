"""grouped_linear(backend=None) runs the backend measured fastest here, not a fixed rule's guess."""

from __future__ import annotations

import pytest
import torch

from runtime.moe import grouped_linear
from runtime.moe.autotune import ENV, MIN_MACS, measured
from runtime.moe.grouped import pick_backend


def _problem(experts: int, rows_each: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    counts = torch.full((experts,), rows_each)
    x = torch.randn(experts * rows_each, k, generator=g, requires_grad=True)
    return x, torch.randn(experts, n, k, generator=g, requires_grad=True), counts


@pytest.fixture
def one_thread():
    """Small GEMMs on two threads on a loaded box mostly time OpenMP's spin-waits; one thread times the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_measured_choice_beats_the_fixed_rule(monkeypatch, one_thread):
    """2048 experts of 4 rows, 184-byte rows: torch._grouped_mm cannot run it (16-byte rule), the fixed rule says
    ``segment``, a Python loop of 3 x 2048 small GEMMs, while one padded ``bmm`` does the same work 3-4x faster."""
    monkeypatch.delenv(ENV, raising=False)
    x, w, counts = _problem(2048, 4, 46, 46)
    assert x.size(0) * 46 * 46 >= MIN_MACS and pick_backend(x, w) == "segment"
    y = grouped_linear(x, w, counts)
    assert y.grad_fn.backend == "bmm"
    assert "bmm" in measured().values()
    ref = grouped_linear(x, w, counts, "segment")
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_small_problems_take_the_fixed_rule_and_a_pin_wins(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    x, w, counts = _problem(4, 8, 16, 16)  # a tiny model's experts: nothing is timed, deterministic everywhere
    before = measured()
    assert grouped_linear(x, w, counts).grad_fn.backend == "torch" == pick_backend(x, w)
    assert measured() == before
    monkeypatch.setenv(ENV, "bmm")
    assert grouped_linear(x, w, counts).grad_fn.backend == "bmm"
    x15, w15, counts15 = _problem(4, 8, 16, 15)  # 60-byte rows: torch._grouped_mm cannot run it
    monkeypatch.setenv(ENV, "torch")
    assert grouped_linear(x15, w15, counts15).grad_fn.backend == "segment"
    monkeypatch.setenv(ENV, "cutlass")
    with pytest.raises(ValueError, match=f"{ENV}='cutlass'"):
        grouped_linear(x, w, counts)
