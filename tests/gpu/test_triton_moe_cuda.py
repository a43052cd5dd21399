"""The Triton MoE kernels compiled for the GPU (``TRITON_INTERPRET=0``), forward and backward, against the eager
reference path in the same dtype, in fp64, and against transformers' own ``grouped_mm`` experts, in fp32 and bf16,
at a shape of several tiles per expert (tests/gpu_readiness checks the logic under the interpreter on CPU)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from runtime.moe import experts_forward
from tests.gpu.common import CUDA, rel
from tests.gpu_readiness.test_triton_moe import _grads, _routing

pytestmark = pytest.mark.gpu

E, H, INTER, TOKENS, TOP_K = 16, 512, 256, 1024, 4
BOUND = {torch.float32: 4e-6, torch.bfloat16: 2e-2}  # vs fp64, norm-wise (K up to 512: a little above 1e-6)
NAMES = ("out", "d_hidden", "d_weights", "d_gate_up", "d_down")


def _upstream(dtype: torch.dtype, gate_up: torch.Tensor, down: torch.Tensor):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=TOP_K, hidden_act="silu"
    )
    config._experts_implementation = "grouped_mm"
    module = Qwen3MoeExperts(config).to(CUDA, dtype)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up)
        module.down_proj.copy_(down)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_triton_experts_match_eager_fp64_and_grouped_mm(dtype: torch.dtype) -> None:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.skip("TRITON_INTERPRET=1: the interpreter, not the compiled kernels (bench/gpu_check sets 0)")
    index, weights = _routing(TOKENS, list(range(E)), TOP_K, seed=3)
    g = torch.Generator().manual_seed(4)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g) * H**-0.5
    down = torch.randn(E, H, INTER, generator=g) * INTER**-0.5
    hidden, grad_out = torch.randn(TOKENS, H, generator=g), torch.randn(TOKENS, H, generator=g)

    def run(impl: str, precision: torch.dtype) -> list[torch.Tensor]:
        inputs = [t.to(CUDA, precision) for t in (hidden, weights, gate_up, down)]
        idx = index.to(CUDA)
        fn = lambda h, w, gu, dn: experts_forward(h, idx, w, gu, dn, F.silu, impl)  # noqa: E731
        return _grads(fn, inputs, grad_out.to(CUDA, precision))

    got, eager, exact = run("triton", dtype), run("eager", dtype), run("eager", torch.float64)
    for name, a, ref_eager, ref_exact in zip(NAMES, got, eager, exact, strict=True):
        assert a.dtype == dtype and a.is_cuda, name
        assert rel(a, ref_exact) < BOUND[dtype], (name, "fp64", rel(a, ref_exact))
        assert rel(a, ref_eager) < 2 * BOUND[dtype], (name, "eager", rel(a, ref_eager))
    module = _upstream(dtype, gate_up, down)
    leaves = [t.to(CUDA, dtype).requires_grad_(True) for t in (hidden, weights)]
    out = module(leaves[0], index.to(CUDA), leaves[1])
    out.backward(grad_out.to(CUDA, dtype))
    upstream = [out.detach(), leaves[0].grad, leaves[1].grad, module.gate_up_proj.grad, module.down_proj.grad]
    for name, a, ref in zip(NAMES, got, upstream, strict=True):
        assert rel(a, ref) < 2 * BOUND[dtype], (name, "grouped_mm", rel(a, ref))
