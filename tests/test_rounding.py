"""The rounding model every parity suite is held to (runtime/rounding.py): two float32 evaluations that sum in
different orders pass against float64 truth as the witness; a dropped or doubled term fails; a bound that could not
see a defect says so instead of passing. The witness of the other kind (the same run on other kernels) is exercised
by the suites themselves and by ``test_reordered_kernels_sum_otherwise`` here."""

from __future__ import annotations

import pytest
import torch

from runtime.rounding import EPS32, POWER_LIMIT, judge


def _terms(seed: int, n: int = 4096, residual: float | None = None) -> torch.Tensor:
    """n float32 terms of size 1 (16 sums of n); ``residual``: the terms cancel, each sum is n * residual."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g, dtype=torch.float64)
    if residual is not None:
        x = x - x.mean(0, keepdim=True) + residual * torch.randn(1, 16, generator=g, dtype=torch.float64)
    return x.float()


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    """Sums of ``block`` terms, then their sum: another BLAS's blocking (MKL's AVX-512 and AVX2 kernels differ so)."""
    return x.view(-1, block, x.shape[1]).sum(1).sum(0)


def _split(x: torch.Tensor, parts: int) -> torch.Tensor:
    """The sum as SP computes it: each rank's share summed, then the partial sums added."""
    return torch.stack([c.sum(0) for c in x.chunk(parts)]).sum(0)


@pytest.mark.parametrize("residual", [None, 1e-3, 1e-4])
@pytest.mark.parametrize("seed", range(8))
def test_permuted_and_split_reductions_pass_against_float64_truth(seed: int, residual: float | None) -> None:
    x = _terms(seed, residual=residual)
    truth = x.double().sum(0)
    ref = x.sum(0)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(100 + seed))
    for got in (x[perm].sum(0), _split(x, 2), _split(x[perm], 4), _blocked(x[perm], 64), _blocked(x, 8)):
        verdict = judge("sum", got, ref, ref.double() - truth)
        assert verdict.failure() is None, verdict.failure()


def test_cancelling_sums_need_the_model_not_a_fixed_fraction() -> None:
    """Where terms cancel, a correct reordering moves the result by more than 1e-5 of itself, which a fixed relative
    bound would call a defect; the model passes it, and still fails a dropped term."""
    x = _terms(3, residual=1e-4)
    ref, got, truth = x.sum(0), _blocked(x, 64), x.double().sum(0)
    relative = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    assert relative > 1e-5, relative  # what a fixed 1e-5 would refuse
    assert judge("sum", got, ref, ref.double() - truth).failure() is None
    assert judge("sum", _blocked(x[8:], 8), ref, ref.double() - truth).failure() is not None  # one block lost


@pytest.mark.parametrize("seed", range(4))
def test_a_dropped_term_fails(seed: int) -> None:
    x = _terms(seed)
    ref, truth = x.sum(0), x.double().sum(0)
    got = _split(x[1:], 2)  # one rank lost one token's term
    verdict = judge("sum", got, ref, ref.double() - truth)
    assert verdict.failure() is not None and verdict.ratio > 10, verdict


def _grads(model: torch.nn.Module, x: torch.Tensor, parts: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Gradients of a token-mean loss over ``x``, accumulated over ``parts`` shares (SP's partial gradients)."""
    model.zero_grad()
    for chunk in x.chunk(parts):
        (scale * model(chunk).square().sum() / x.shape[0]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_model_split_over_ranks_passes_and_a_doubled_share_fails() -> None:
    """The suites' use: gradients of a small model accumulated over 2 shares against one pass, the float64 run as
    the witness: every parameter passes; a doubled share fails on every parameter."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    x = torch.randn(2048, 64)
    ref, split, doubled = _grads(model, x, 1), _grads(model, x, 2), _grads(model, x, 2, scale=2.0)
    truth = _grads(copy.deepcopy(model).double(), x.double(), 1)
    for name in ref:
        noise = ref[name].double() - truth[name]
        assert judge(name, split[name], ref[name], noise).failure() is None, name
        assert judge(name, doubled[name], ref[name], noise).failure() is not None, name


def test_a_bound_without_power_says_so() -> None:
    ref = torch.ones(16)
    verdict = judge("loss", ref, ref, torch.full((16,), 1e-2))  # noise of 1% of the value: no power left
    assert verdict.power > POWER_LIMIT
    assert "could not see a defect" in verdict.failure()


def test_exact_values_and_nan() -> None:
    zero = torch.zeros(4)
    assert judge("unused", zero, zero, zero).failure() is None  # a gradient that is exactly zero on both sides
    assert judge("unused", zero + 1e-20, zero, zero).failure() is not None  # a mathematical zero is not non-zero
    nan = torch.full((4,), float("nan"))
    assert judge("x", nan, torch.ones(4), torch.ones(4) * EPS32).failure() is not None
    with pytest.raises(ValueError, match="shapes differ"):
        judge("x", torch.ones(3), torch.ones(4), torch.ones(4))


def test_reordered_kernels_sum_otherwise() -> None:
    """``tests.dist_utils.start_reordered``'s rank really sums in another order (else its witness would be zero and
    every bound a floor): a matmul and a softmax there differ from this process's by rounding, not more."""
    from tests.dist_utils import start_reordered

    here = _kernel_probe(0, 1)
    there = start_reordered(_kernel_probe)()
    for name in here:
        assert not torch.equal(here[name], there[name]), name
        truth = _kernel_probe(0, 1, torch.float64)[name]
        verdict = judge(name, there[name], here[name], here[name].double() - truth)
        assert verdict.failure() is None, verdict.failure()


def _kernel_probe(rank: int, world_size: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A matmul over a long inner dimension and a softmax backward (module level: it runs on a spawned rank)."""
    g = torch.Generator().manual_seed(0)
    a, b = (
        torch.rand(64, 4096, generator=g, dtype=torch.float64),
        torch.rand(4096, 48, generator=g, dtype=torch.float64),
    )
    s = torch.randn(16, 2048, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    (s.softmax(-1) * torch.arange(2048, dtype=dtype)).sum().backward()
    return {"matmul": (a.to(dtype) @ b.to(dtype)).double(), "softmax grad": s.grad.double()}


def test_a_weaker_bound_is_accepted_only_where_named_with_a_reason() -> None:
    """``tests.tolerance``: a tensor whose float32 noise is 2% of itself fails as powerless, unless the test names it
    with a reason; even then a doubled value fails."""
    from tests.tolerance import assert_within_rounding

    ref = {"grads": {"a": torch.ones(16), "b": torch.ones(16)}}
    witness = {"grads": {"a": torch.ones(16), "b": torch.full((16,), 1.0025)}}  # b's noise: 2.5e-3 of b
    with pytest.raises(AssertionError, match="grads.b: the rounding bound is 2.00e-02"):
        assert_within_rounding(ref, ref, witness)
    assert_within_rounding(ref, ref, witness, weak=(("grads.b", "b cancels"),))
    doubled = {"grads": {"a": torch.ones(16), "b": torch.full((16,), 2.0)}}
    with pytest.raises(AssertionError, match="grads.b: differs by"):
        assert_within_rounding(doubled, ref, witness, weak=(("grads.b", "b cancels"),))
    with pytest.raises(ValueError, match="needs its reason"):
        assert_within_rounding(ref, ref, witness, weak=(("grads.b", " "),))
