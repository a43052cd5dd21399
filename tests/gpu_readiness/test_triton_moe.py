"""The Triton MoE kernels (``runtime.kernels.moe_triton``) under Triton's interpreter, on CPU tensors.

The interpreter runs the kernels' own indexing, masks, tiling, fp32 accumulation and stores with numpy, so every
case that decides the kernels' logic is checked here, forward and backward: rows per expert of 0, 1, a full
64-row tile, a tile plus one and several tiles; N and K that are not multiples of the blocks; a strided weight;
top-k 1 to 3; experts that own no row; EP-sharded expert ranges (``expert_offset``). References: the eager
reference path (bitwise transformers' loop), transformers' own ``grouped_mm`` experts, and fp64.
What the interpreter cannot show (speed, the bf16 ``tl.dot`` instruction, TF32, ...) is listed in
docs/performance.md.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.kernels.moe_triton import BLOCK_M, triton_grouped_linear
from runtime.moe import experts_forward, grouped_linear, local_expert_range
from tests.gpu_readiness.interpreter import kernel_device

# Relative (norm-wise) error bounds against fp64 on the same rounded inputs: about four units of roundoff of the
# storage dtype (fp32: the 1e-6 the grouped paths meet).
BOUND = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
HALF_DTYPES = [torch.float16, torch.bfloat16]
E, H, INTER = 8, 48, 40  # K = 48 and N = 80 are not multiples of the 32/64 blocks: masked edges in both


@pytest.fixture(scope="module")
def device() -> torch.device:
    return kernel_device()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _grads(fn, inputs: list[torch.Tensor], grad_out: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES], ids=str)
def test_grouped_linear_tiles_and_masks(dtype, device):
    """Rows per expert 1, 0, 64, 65, 0, 130, 3 (a tile, a tile + 1, several tiles), a strided weight."""
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([1, 0, BLOCK_M, BLOCK_M + 1, 0, 2 * BLOCK_M + 2, 3])
    rows, experts, n, k = int(counts.sum()), counts.numel(), 80, 48
    x = torch.randn(rows, k, generator=g).to(dtype)
    weight = torch.randn(experts, k, n, generator=g).to(dtype).transpose(1, 2)  # (E, N, K), not contiguous
    grad_out = torch.randn(rows, n, generator=g).to(dtype)
    on = [t.to(device) for t in (x, weight, grad_out, counts)]
    got = _grads(lambda a, w: triton_grouped_linear(a, w, on[3]), on[:2], on[2])
    ref = _grads(lambda a, w: grouped_linear(a, w, counts, "segment"), [x.double(), weight.double()], grad_out)
    for name, a, b in zip(("y", "dx", "dw"), got, ref, strict=True):
        assert a.dtype == dtype, name
        assert _rel(a, b) < BOUND[dtype], (name, _rel(a, b))
    assert torch.count_nonzero(got[2][on[3] == 0]) == 0  # experts without rows: an exact zero gradient


def test_no_rows_at_all_gives_an_empty_output_and_a_zero_weight_gradient(device):
    """A rank whose experts received no token (EP): nothing is launched, the weight still gets its zero gradient."""
    x = torch.zeros(0, 48, device=device, requires_grad=True)
    weight = torch.randn(3, 16, 48, device=device, requires_grad=True)
    y = triton_grouped_linear(x, weight, torch.zeros(3, dtype=torch.long, device=device))
    assert y.shape == (0, 16)
    y.sum().backward()
    assert weight.grad is not None and torch.count_nonzero(weight.grad) == 0 and x.grad.shape == (0, 48)


def test_unsupported_dtype_is_refused(device):
    x, weight = torch.randn(5, 48, dtype=torch.float64), torch.randn(2, 16, 48, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64 is not supported"):
        triton_grouped_linear(x.to(device), weight.to(device), torch.tensor([2, 3], device=device))


def _routing(tokens: int, allowed: list[int], top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k experts per token drawn from ``allowed`` (the others get no row), random weights."""
    g = torch.Generator().manual_seed(seed)
    allowed_t = torch.tensor(allowed)
    index = torch.stack([allowed_t[torch.randperm(len(allowed), generator=g)[:top_k]] for _ in range(tokens)])
    return index, torch.rand(tokens, top_k, generator=g) + 0.1


def _weights(dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g) * H**-0.5
    down = torch.randn(E, H, INTER, generator=g) * INTER**-0.5
    return gate_up.to(dtype), down.to(dtype)


# (tokens, experts that get rows, top-k): uneven rows with experts left empty, and top-k 1, 2 and 3.
ROUTINGS = {
    "top2, experts 2 and 6 empty": (150, [0, 1, 3, 4, 5, 7], 2),
    "top1, one expert with most rows": (150, [3, 3, 3, 3, 1, 5], 1),
    "top3, all experts": (70, list(range(E)), 3),
}


def _upstream_experts(dtype: torch.dtype, gate_up: torch.Tensor, down: torch.Tensor, top_k: int):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=top_k, hidden_act="silu"
    )
    config._experts_implementation = "grouped_mm"  # transformers.integrations.moe: torch._grouped_mm
    module = Qwen3MoeExperts(config).to(dtype)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up)
        module.down_proj.copy_(down)
    return module


def _upstream_grads(module, hidden, index, weights, grad_out) -> list[torch.Tensor]:
    leaves = [hidden.detach().clone().requires_grad_(True), weights.detach().clone().requires_grad_(True)]
    module.zero_grad(set_to_none=True)
    out = module(leaves[0], index, leaves[1])
    out.backward(grad_out)
    return [out.detach(), leaves[0].grad, leaves[1].grad, module.gate_up_proj.grad, module.down_proj.grad]


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES], ids=str)
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_experts_match_eager_and_transformers_grouped_mm(dtype, routing, device):
    tokens, allowed, top_k = ROUTINGS[routing]
    index, weights = _routing(tokens, allowed, top_k, seed=len(routing))
    gate_up, down = _weights(dtype)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(tokens, H, generator=g).to(dtype)
    grad_out = torch.randn(tokens, H, generator=g).to(dtype)
    weights = weights.to(dtype)

    def run(impl: str, precision: torch.dtype = dtype, on: torch.device | str = "cpu") -> list:
        inputs = [t.to(on, precision) for t in (hidden, weights, gate_up, down)]
        idx = index.to(on)
        fn = lambda h, w, gu, dn: experts_forward(h, idx, w, gu, dn, F.silu, impl)  # noqa: E731
        return _grads(fn, inputs, grad_out.to(on))

    got, eager, exact = run("triton", on=device), run("eager"), run("eager", torch.float64)
    upstream = _upstream_grads(_upstream_experts(dtype, gate_up, down, top_k), hidden, index, weights, grad_out)
    names = ("out", "d_hidden", "d_weights", "d_gate_up", "d_down")
    for name, a, ref_eager, ref_up, ref_exact in zip(names, got, eager, upstream, exact, strict=True):
        assert a.dtype == dtype, name
        assert _rel(a, ref_exact) < BOUND[dtype], (name, "fp64", _rel(a, ref_exact))
        # Against each implementation in the same dtype: their own rounding adds to ours.
        assert _rel(a, ref_eager) < 2 * BOUND[dtype], (name, "eager", _rel(a, ref_eager))
        assert _rel(a, ref_up) < 2 * BOUND[dtype], (name, "grouped_mm", _rel(a, ref_up))
    unused = torch.ones(E, dtype=torch.bool)
    unused[index.unique()] = False
    assert unused.any() == (len(set(allowed)) < E)
    assert torch.count_nonzero(got[3].cpu()[unused]) == 0 and torch.count_nonzero(got[4].cpu()[unused]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ep_sharded_expert_ranges(dtype, device):
    """Each EP rank's local experts (``expert_offset``; slots routed elsewhere ignored) add up to the full run."""
    index, weights = _routing(80, list(range(E)), 2, seed=5)
    gate_up, down = _weights(dtype, seed=6)
    g = torch.Generator().manual_seed(7)
    hidden, grad_out = torch.randn(80, H, generator=g).to(dtype), torch.randn(80, H, generator=g).to(dtype)
    weights = weights.to(dtype)

    def run(gu: torch.Tensor, dn: torch.Tensor, offset: int, impl: str, precision: torch.dtype, on) -> list:
        inputs = [t.to(on, precision) for t in (hidden, weights, gu, dn)]
        idx = index.to(on)
        fn = lambda h, w, a, b: experts_forward(h, idx, w, a, b, F.silu, impl, expert_offset=offset)  # noqa: E731
        return _grads(fn, inputs, grad_out.to(on))

    exact = run(gate_up, down, 0, "eager", torch.float64, "cpu")
    for ep in (2, 4):
        shards = [local_expert_range(E, ep, r) for r in range(ep)]
        parts = [run(gate_up[a:b], down[a:b], a, "triton", dtype, device) for a, b in shards]
        for i, name in enumerate(("out", "d_hidden", "d_weights")):
            total = sum(p[i].double().cpu() for p in parts)
            assert _rel(total, exact[i]) < 2 * BOUND[dtype], (ep, name, _rel(total, exact[i]))
        for (a, b), part in zip(shards, parts, strict=True):
            assert _rel(part[3], exact[3][a:b]) < BOUND[dtype] and _rel(part[4], exact[4][a:b]) < BOUND[dtype]


def test_no_rows_at_all(device):
    """No tokens, and tokens none of which is routed to this rank's experts: zeros, zero weight gradients."""
    gate_up, down = (t.to(device) for t in _weights(torch.float32, seed=8))
    index, weights = (t.to(device) for t in _routing(17, list(range(E)), 2, seed=9))
    hidden = torch.randn(17, H, device=device)
    for h, idx, w in ((hidden[:0], index[:0], weights[:0]), (hidden, index % 4, weights)):
        gu, dn = gate_up[4:].clone().requires_grad_(True), down[4:].clone().requires_grad_(True)
        out = experts_forward(h, idx, w, gu, dn, F.silu, "triton", expert_offset=4)
        out.sum().backward()
        assert out.shape == h.shape and torch.count_nonzero(out) == 0
        assert torch.count_nonzero(gu.grad) == 0 and torch.count_nonzero(dn.grad) == 0
