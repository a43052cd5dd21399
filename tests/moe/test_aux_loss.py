"""global_load_balancing_loss in one process equals transformers' load_balancing_loss_func (value and gradient)."""

from __future__ import annotations

import pytest
import torch

from runtime.moe import global_load_balancing_loss

E, K = 8, 2


@pytest.fixture(scope="module")
def reference():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    return load_balancing_loss_func


def _grad(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(loss, x)[0]


def test_matches_transformers(reference):
    torch.manual_seed(0)
    x = torch.randn(3, 10, E, requires_grad=True)  # 3 layers of 10 tokens
    layers = tuple(x.unbind(0))
    ref = reference(layers, E, K)
    ref_grad = _grad(ref, x)
    for logits in (layers, list(layers)):
        ours = global_load_balancing_loss(logits, K, E)
        assert torch.allclose(ours, ref, rtol=1e-6, atol=0)
        assert torch.allclose(_grad(ours, x), ref_grad, rtol=1e-5, atol=1e-8)
    single = global_load_balancing_loss(layers[0], K, E)
    assert torch.allclose(single, reference(layers[:1], E, K), rtol=1e-6, atol=0)


def test_token_mask_matches_attention_mask(reference):
    torch.manual_seed(1)
    batch, seq = 2, 6
    x = torch.randn(2, batch * seq, E, requires_grad=True)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, 4:] = 0
    mask[1, 1:3] = 0
    ref = reference(tuple(x.unbind(0)), E, K, attention_mask=mask)
    ours = global_load_balancing_loss(tuple(x.unbind(0)), K, E, token_mask=mask)
    assert torch.allclose(ours, ref, rtol=1e-6, atol=0)
    assert torch.allclose(_grad(ours, x), _grad(ref, x), rtol=1e-5, atol=1e-8)


def test_no_tokens_and_errors():
    empty = torch.zeros(0, E, requires_grad=True)
    loss = global_load_balancing_loss(empty, K, E)
    assert loss.item() == 0.0
    loss.backward()
    with pytest.raises(ValueError, match="num_experts"):
        global_load_balancing_loss(torch.randn(4, E + 1), K, E)
    with pytest.raises(ValueError, match="top_k"):
        global_load_balancing_loss(torch.randn(4, E), E + 1, E)
    with pytest.raises(ValueError, match="token_mask"):
        global_load_balancing_loss(torch.randn(4, E), K, E, token_mask=torch.ones(5))
