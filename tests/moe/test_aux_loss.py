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


def test_hook_ignores_the_sp_padding_the_collator_marks(reference):
    """`global_aux_loss(fn, token_mask)` (what the generated MoE models call) on a row with the SP padding segment
    `shard_row` appends equals upstream's loss on the unpadded row; with no mask it is upstream's function itself."""
    from runtime.data.sp_batch import shard_row
    from runtime.moe.hooks import global_aux_loss

    assert global_aux_loss(reference) is reference and global_aux_loss(reference, None) is reference
    torch.manual_seed(2)
    row = {"input_ids": torch.arange(1, 8)[None], "position_ids": torch.arange(7)[None]}  # 7 tokens: 1 pad at sp=2
    masks = [shard_row(row, 2, rank)["token_mask"] for rank in range(2)]
    assert torch.cat(masks, 1).tolist() == [[True] * 7 + [False]]
    x = torch.randn(2, 8, E, requires_grad=True)  # 2 layers, the padded row's 8 tokens
    ours = global_aux_loss(reference, torch.cat(masks, 1))(tuple(x.unbind(0)), E, K)
    ref = reference(tuple(x[:, :7].unbind(0)), E, K)
    assert torch.allclose(ours, ref, rtol=1e-6, atol=0)
    grad = _grad(ours, x)
    assert torch.allclose(grad[:, :7], _grad(ref, x)[:, :7], rtol=1e-5, atol=1e-8)
    assert grad[:, 7].eq(0).all()  # the padding token gets no gradient from the balance term
