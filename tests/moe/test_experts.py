"""experts_forward: eager is bitwise transformers' Qwen3MoeExperts; grouped (every CPU backend) matches it.

The Triton path is tested under the interpreter in tests/gpu_readiness/test_triton_moe.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.kernels.moe_triton import triton_unavailable_reason
from runtime.moe import experts_forward, grouped_linear, local_expert_range
from runtime.moe.grouped import pick_backend

E, K, H, INTER = 8, 2, 32, 16


def _weights(seed: int = 0, experts: int = E, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * INTER, H, generator=g, dtype=dtype) * H**-0.5
    down = torch.randn(experts, H, INTER, generator=g, dtype=dtype) * INTER**-0.5
    return gate_up, down


def _routing(tokens: int, allowed: list[int], seed: int = 1, top_k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k experts per token drawn from ``allowed`` (so the others get zero tokens), random weights."""
    g = torch.Generator().manual_seed(seed)
    allowed_t = torch.tensor(allowed)
    index = torch.stack([allowed_t[torch.randperm(len(allowed), generator=g)[:top_k]] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return index.reshape(tokens, top_k), weights


def _run(fn, hidden, weights, gate_up, down, grad_out):
    """Forward + backward; returns the output and the gradients of every input."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weights, gate_up, down)]
    out = fn(*leaves)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def qwen3_experts():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=INTER,
        num_experts=E,
        num_experts_per_tok=K,
        hidden_act="silu",
        norm_topk_prob=True,
    )
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    experts, router = Qwen3MoeExperts(config), Qwen3MoeTopKRouter(config)
    gate_up, down = _weights(0)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
        router.weight.normal_(0.0, 1.0)
    return experts, router


def test_eager_is_bitwise_transformers(qwen3_experts):
    experts, router = qwen3_experts
    torch.manual_seed(3)
    hidden = torch.randn(37, H)
    grad_out = torch.randn(37, H)
    _, weights, index = router(hidden)  # the real router: experts repeat across tokens

    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weights)]
    experts.zero_grad(set_to_none=True)
    ref_out = experts(leaves[0], index, leaves[1])
    ref_out.backward(grad_out)
    ref = [ref_out.detach(), leaves[0].grad, leaves[1].grad, experts.gate_up_proj.grad, experts.down_proj.grad]

    ours = _run(
        lambda h, w, gu, dn: experts_forward(h, index, w, gu, dn, experts.act_fn, "eager"),
        hidden,
        weights,
        experts.gate_up_proj,
        experts.down_proj,
        grad_out,
    )
    for name, a, b in zip(("out", "d_hidden", "d_weights", "d_gate_up", "d_down"), ours, ref, strict=True):
        assert torch.equal(a, b), name


def test_eager_local_experts_are_bitwise_the_full_run():
    """With every slot routed to experts 4..7, those experts alone (expert_offset=4) give the same bits."""
    gate_up, down = _weights(1)
    index, weights = _routing(19, [4, 5, 6, 7], seed=2)
    hidden, grad_out = torch.randn(19, H), torch.randn(19, H)
    full = _run(
        lambda h, w, gu, dn: experts_forward(h, index, w, gu, dn, F.silu, "eager"),
        hidden,
        weights,
        gate_up,
        down,
        grad_out,
    )
    local = _run(
        lambda h, w, gu, dn: experts_forward(h, index, w, gu, dn, F.silu, "eager", expert_offset=4),
        hidden,
        weights,
        gate_up[4:],
        down[4:],
        grad_out,
    )
    for a, b in zip(local[:3], full[:3], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(local[3], full[3][4:]) and torch.equal(local[4], full[4][4:])


@pytest.mark.parametrize("backend", [None, "torch", "segment", "bmm"])
def test_grouped_matches_eager(backend):
    gate_up, down = _weights(4)
    torch.manual_seed(5)
    cases = [
        _routing(41, list(range(E)), seed=6),  # all experts, repeated across tokens
        _routing(23, [0, 2, 3, 7], seed=7),  # experts 1, 4, 5, 6 receive zero tokens
        _routing(9, [6, 1, 2], seed=8, top_k=3),
    ]
    for index, weights in cases:
        tokens = index.size(0)
        hidden, grad_out = torch.randn(tokens, H), torch.randn(tokens, H)
        ref = _run(
            lambda h, w, gu, dn, idx=index: experts_forward(h, idx, w, gu, dn, F.silu, "eager"),
            hidden,
            weights,
            gate_up,
            down,
            grad_out,
        )
        got = _run(
            lambda h, w, gu, dn, idx=index: experts_forward(h, idx, w, gu, dn, F.silu, "grouped", backend=backend),
            hidden,
            weights,
            gate_up,
            down,
            grad_out,
        )
        for name, a, b in zip(("out", "d_hidden", "d_weights", "d_gate_up", "d_down"), got, ref, strict=True):
            assert _rel(a, b) < 1e-6, (name, backend, _rel(a, b))
        unused = torch.ones(E, dtype=torch.bool)
        unused[index.unique()] = False
        assert torch.count_nonzero(got[3][unused]) == 0 and torch.count_nonzero(got[4][unused]) == 0


def test_grouped_other_activations():
    """The SiLU gate has a fused autograd function; every other activation goes through plain autograd."""
    gate_up, down = _weights(14)
    index, weights = _routing(21, list(range(E)), seed=15)
    hidden, grad_out = torch.randn(21, H), torch.randn(21, H)
    for act in (F.gelu, torch.nn.SiLU(), torch.tanh):
        ref = _run(
            lambda h, w, gu, dn, a=act: experts_forward(h, index, w, gu, dn, a, "eager"),
            hidden,
            weights,
            gate_up,
            down,
            grad_out,
        )
        got = _run(
            lambda h, w, gu, dn, a=act: experts_forward(h, index, w, gu, dn, a, "grouped"),
            hidden,
            weights,
            gate_up,
            down,
            grad_out,
        )
        for a, b in zip(got, ref, strict=True):
            assert _rel(a, b) < 1e-6, act


def test_grouped_expert_offset_and_empty_inputs():
    gate_up, down = _weights(9)
    index, weights = _routing(17, list(range(E)), seed=10)
    hidden = torch.randn(17, H)
    full = experts_forward(hidden, index, weights, gate_up, down, F.silu, "grouped")
    halves = sum(
        experts_forward(hidden, index, weights, gate_up[a:b], down[a:b], F.silu, "grouped", expert_offset=a)
        for a, b in (local_expert_range(E, 2, 0), local_expert_range(E, 2, 1))
    )
    assert _rel(halves, full) < 1e-6
    # No tokens at all, and tokens none of which is routed to the local experts: zeros, zero weight grads.
    for h, idx, w in ((hidden[:0], index[:0], weights[:0]), (hidden, index % 4, weights)):
        gu, dn = gate_up[4:].clone().requires_grad_(True), down[4:].clone().requires_grad_(True)
        out = experts_forward(h, idx, w, gu, dn, F.silu, "grouped", expert_offset=4)
        out.sum().backward()
        assert out.shape == h.shape and torch.count_nonzero(out) == 0
        assert torch.count_nonzero(gu.grad) == 0 and torch.count_nonzero(dn.grad) == 0


def test_grouped_linear_backends_and_expanded_grad():
    """torch._grouped_mm's own CPU backward fails on a stride-0 gradient; ours takes one (out.sum())."""
    torch.manual_seed(11)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, 16, requires_grad=True)
    w = torch.randn(4, 8, 16, requires_grad=True)
    ref_y = torch.cat([x[0:3] @ w[0].T, x[3:8] @ w[2].T, x[8:9] @ w[3].T])
    ref_gx, ref_gw = torch.autograd.grad(ref_y.sum(), (x, w))
    for backend in ("torch", "segment", "bmm"):
        y = grouped_linear(x, w, counts, backend)
        gx, gw = torch.autograd.grad(y.sum(), (x, w))
        assert _rel(y, ref_y) < 1e-6 and _rel(gx, ref_gx) < 1e-6 and _rel(gw, ref_gw) < 1e-6, backend
        assert torch.count_nonzero(gw[1]) == 0
    assert pick_backend(x, w) == "torch"
    assert pick_backend(torch.randn(9, 15), torch.randn(4, 8, 15)) == "segment"  # 60-byte rows: not aligned
    assert pick_backend(x.double(), w.double()) == "segment"


def test_errors(monkeypatch):
    gate_up, down = _weights(0)
    index, weights = _routing(5, list(range(E)))
    hidden = torch.randn(5, H)
    with pytest.raises(ValueError, match="unknown impl"):
        experts_forward(hidden, index, weights, gate_up, down, F.silu, "fast")
    with pytest.raises(ValueError, match="top_k_index"):
        experts_forward(hidden, index[:4], weights, gate_up, down, F.silu)
    with pytest.raises(ValueError, match="gate_up_proj"):
        experts_forward(hidden, index, weights, gate_up, down[:, :, :-1], F.silu)
    with pytest.raises(ValueError, match="unknown backend"):
        experts_forward(hidden, index, weights, gate_up, down, F.silu, "grouped", backend="cutlass")
    with pytest.raises(ValueError, match="divisible by the EP size"):
        local_expert_range(6, 4, 0)
    # Without the interpreter (tests/conftest.py turns it on), CPU tensors are refused with the reason.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_unavailable_reason(hidden) is not None
    with pytest.raises(RuntimeError, match="impl='triton'"):
        experts_forward(hidden, index, weights, gate_up, down, F.silu, "triton")
