"""The chunked linear + cross-entropy against the plain computation, with and without a final-logit softcap."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.kernels.cross_entropy import linear_cross_entropy_sum


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("chunk_size", [3, 64])
def test_chunked_equals_full_logits(softcap: float | None, chunk_size: int) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 8, generator=g, requires_grad=True)
    weight = (torch.randn(29, 8, generator=g) * 2).requires_grad_()  # logits of several units: a cap of 2 bends them
    bias = torch.randn(29, generator=g, requires_grad=True)
    targets = torch.randint(0, 29, (11,), generator=g)
    targets[[0, 5]] = -100
    loss, count = linear_cross_entropy_sum(hidden, weight, targets, bias=bias, chunk_size=chunk_size, softcap=softcap)
    logits = hidden @ weight.t() + bias
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    ref = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    assert count.item() == 9
    # Summation order differs (per chunk, and the backward recomputes each chunk): fp32 rounding, not bitwise.
    assert relative_error(loss, ref) < 1e-6
    got = torch.autograd.grad(loss, (hidden, weight, bias))
    want = torch.autograd.grad(ref, (hidden, weight, bias))
    for a, b in zip(got, want, strict=True):
        assert relative_error(a, b) < 1e-5
    if softcap is not None:  # the cap changes the loss: the comparison above could not pass without it
        plain = F.cross_entropy(hidden @ weight.t() + bias, targets, ignore_index=-100, reduction="sum")
        assert relative_error(plain, ref) > 1e-2
