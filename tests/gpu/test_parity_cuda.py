"""Generated vs upstream with parallelism off, on CUDA, fp32, deterministic kernels: the outputs, the loss and every
parameter's gradient bitwise equal (the brief's numerics standard, checked on CPU by tests/parity and tests/dit),
for a tiny generated qwen3 (packed row) and a tiny Wan DiT."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.common import CUDA, deterministic, on

pytestmark = pytest.mark.gpu


def _assert_grads_equal(upstream: torch.nn.Module, generated: torch.nn.Module) -> None:
    ref = {n: p.grad for n, p in upstream.named_parameters()}
    got = {n: p.grad for n, p in generated.named_parameters()}
    assert ref.keys() == got.keys()
    for name, grad in ref.items():
        if grad is None:
            assert got[name] is None, name
        else:
            assert torch.equal(grad, got[name]), name


def test_generated_qwen3_is_bitwise_upstream_on_cuda() -> None:
    from tests.parity.dense import models, packed_batch

    upstream, generated = (m.to(CUDA) for m in models("qwen3"))
    batch = on(packed_batch((7, 10, 4)))
    with deterministic():
        outputs = [m(**batch) for m in (upstream, generated)]
        for out in outputs:
            out.loss.backward()
    assert outputs[0].logits.device.type == CUDA.type
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert torch.equal(outputs[0].loss, outputs[1].loss)
    _assert_grads_equal(upstream, generated)


def test_generated_wan_is_bitwise_diffusers_on_cuda() -> None:
    from tests.dit.cases import CASES, inputs, shell, upstream_like

    case = CASES["wan"]
    generated = shell(case)
    upstream = upstream_like(case, generated)
    upstream, generated = upstream.to(CUDA), generated.to(CUDA)
    kwargs = on(inputs(case))
    with deterministic():
        outs = [m(**kwargs)[0] for m in (upstream, generated)]
        for out in outs:
            out.float().square().mean().backward()
    assert outs[0].device.type == CUDA.type and torch.equal(outs[0], outs[1])
    _assert_grads_equal(upstream, generated)
