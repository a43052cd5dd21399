"""Experts whose weight layout the fused kernels do not compute are refused, never silently misread.

The kernels take transformers' default experts layout (concatenated gate/up rows, (E, out, in), no biases,
``act(gate) * up``). gpt-oss's experts carry biases, transposed and interleaved weights and a clamped activation;
without the check the grouped kernel either crashed by luck on a shape or, with shapes that fit, dropped the biases.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from runtime.moe.dispatch import check_expert_layouts, expert_layout_problem


def _routing(tokens: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return index, torch.rand(tokens, top_k, generator=g)


def _gpt_oss_experts(impl: str) -> GptOssExperts:
    config = GptOssConfig(hidden_size=16, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = impl
    torch.manual_seed(0)
    module = GptOssExperts(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.1)
    return module


def test_gpt_oss_experts_are_refused_by_the_fused_kernels() -> None:
    module = _gpt_oss_experts("patchgen_grouped")
    problem = expert_layout_problem(module)
    assert problem is not None
    for part in (
        "expert biases",
        "transposed",
        "interleaved",
        "_apply_gate",
        "experts_implementation: patchgen_eager",
    ):
        assert part in problem
    index, weights = _routing(5, 4, 2)
    with pytest.raises(ValueError, match="expert biases"):
        module(torch.randn(5, 16), index, weights)
    with pytest.raises(ValueError, match="expert biases"):
        check_expert_layouts(module)


def test_eager_keeps_upstream_forward_for_biased_experts() -> None:
    """The way out the error names: upstream's own loop, which honours the biases (no refusal, no kernel)."""
    module = _gpt_oss_experts("eager")
    check_expert_layouts(module)  # eager is upstream's code: nothing to refuse
    index, weights = _routing(5, 4, 2)
    x = torch.randn(5, 16)
    out = module(x, index, weights)
    with torch.no_grad():
        module.gate_up_proj_bias.zero_()
    assert not torch.equal(out, module(x, index, weights))  # the biases take part in upstream's result


def test_the_layout_kernel_computes_upstreams_experts() -> None:
    """``patchgen_eager`` (the kernel expert parallelism runs for such experts) is upstream's loop up to rounding:
    biases, interleaved gate/up and the clamped gate included, outputs and every gradient (1e-6 relative: fp32
    sums over 16 terms in another order)."""
    from runtime.moe.dispatch import LAYOUT_KERNEL, register_experts_kernels

    register_experts_kernels()
    results = []
    for impl in ("eager", LAYOUT_KERNEL):
        module = _gpt_oss_experts(impl)
        with torch.no_grad():
            module.gate_up_proj.mul_(40.0)  # pre-activations past the clamp limit (7)
        index, weights = _routing(6, 4, 2)
        x = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
        out = module(x, index, weights)
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in module.named_parameters()}))
    (ref, ref_grads), (got, got_grads) = results
    assert ((got - ref).norm() / ref.norm()) < 1e-6
    for name, grad in ref_grads.items():
        assert ((got_grads[name] - grad).norm() / grad.norm()) < 1e-6, name


def test_a_bias_parameter_on_default_layout_experts_is_refused() -> None:
    """A model whose experts class declares the default layout but holds a bias parameter: the kernels would drop
    it, so the parameters themselves are checked, not only the class flags."""
    config = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "patchgen_grouped"
    module = Qwen3MoeExperts(config)
    assert expert_layout_problem(module) is None
    module.register_parameter("down_proj_bias", torch.nn.Parameter(torch.ones(4, 16)))
    problem = expert_layout_problem(module)
    assert problem is not None and "expert biases" in problem
