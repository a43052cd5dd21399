"""Parallelism off: every generated DiT is bitwise equal to its diffusers class (output and every gradient)."""

from __future__ import annotations

import pytest
import torch

from tests.dit.cases import CASES, inputs, loss_and_grads, shell, upstream_like


@pytest.mark.parametrize("name", sorted(CASES))
def test_generated_equals_diffusers_bitwise(name: str) -> None:
    case = CASES[name]
    model = shell(case)
    ref = upstream_like(case, model)
    kwargs = inputs(case)
    out, loss, grads = loss_and_grads(model, kwargs)
    ref_out, ref_loss, ref_grads = loss_and_grads(ref, kwargs)
    assert torch.equal(out, ref_out)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    assert sum(g is not None for g in grads.values()) > 10
    for key, grad in ref_grads.items():
        assert (grads[key] is None and grad is None) or torch.equal(grads[key], grad), key
