"""The attention paths on CUDA: each SDPA backend (flash, memory-efficient, cuDNN) through the runtime's Ulysses
wrapper and ring attention at sp=1; the log-sum-exp attention's CUDA dispatch (``aten`` efficient kernel and its
backward, which ring attention's blocks and merge use); the DiT ring path's key masks (padding keys, padded text
keys) on the efficient kernel. References: fp32/fp64 math written out on the same device."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.gpu.common import CUDA, rel

pytestmark = pytest.mark.gpu

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
BF16 = 2e-2  # bf16 inputs against an fp32 reference, norm-wise


def _qkv(b: int, h: int, s: int, d: int, dtype: torch.dtype, hkv: int | None = None, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, h, s, d), (b, hkv or h, s, d), (b, hkv or h, s, d)]
    return [torch.randn(shape, generator=g).to(CUDA, dtype).requires_grad_(True) for shape in shapes]


def _reference(q, k, v, scale: float, allowed: torch.Tensor | None = None, causal: bool = False):
    """softmax(q k^T * scale) v in fp64, GQA heads repeated; (out, lse)."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.nan_to_num(torch.exp(scores - lse[..., None]))
    return probs @ v, lse


def _grads(out: torch.Tensor, leaves: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, leaves, grad))


class _Attention(torch.nn.Module):
    """What transformers' sdpa forward reads from an attention module."""

    is_causal = True
    num_key_value_groups = 2


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_sdpa_backends_through_ulysses_and_ring_at_sp1(backend: str) -> None:
    from runtime.sp.ring import ring_attention
    from runtime.sp.ulysses import ulysses_attention

    q, k, v = _qkv(2, 8, 256, 64, torch.bfloat16, hkv=4)
    scale = 64**-0.5
    grad = torch.randn(2, 8, 256, 64, device=CUDA, dtype=torch.bfloat16)
    ref, _ = _reference(q, k, v, scale, causal=True)
    ref_grads = _grads(_reference_autograd(q, k, v, scale), [q, k, v], grad.double())
    with sdpa_kernel([BACKENDS[backend]]):
        out, _ = ulysses_attention("sdpa")(_Attention(), q, k, v, None, scaling=scale, dropout=0.0)
        out = out.transpose(1, 2)  # transformers' layout (b, s, h, d) back to (b, h, s, d)
        assert rel(out, ref) < BF16, ("ulysses", rel(out, ref))
        for name, a, b in zip("qkv", _grads(out, [q, k, v], grad), ref_grads, strict=True):
            assert rel(a, b) < BF16, ("ulysses", name, rel(a, b))
    # ring attention without a ring builds a boolean mask: flash has no mask argument, so efficient / cuDNN / math
    with sdpa_kernel([BACKENDS[backend], SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        out = ring_attention(q, k, v, group=None, causal=True, scale=scale)
    assert rel(out, ref) < BF16, ("ring", rel(out, ref))
    for name, a, b in zip("qkv", _grads(out, [q, k, v], grad), ref_grads, strict=True):
        assert rel(a, b) < BF16, ("ring", name, rel(a, b))


def _reference_autograd(q, k, v, scale: float) -> torch.Tensor:
    """The causal reference in fp64 with autograd (leaves: q, k, v)."""
    qd, kd, vd = (t.double() for t in (q, k, v))
    kd = kd.repeat_interleave(qd.shape[1] // kd.shape[1], 1)
    vd = vd.repeat_interleave(qd.shape[1] // vd.shape[1], 1)
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = (qd @ kd.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ vd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("keys", [64, 40], ids=["keys64", "keys40-unaligned"])
def test_lse_attention_cuda_dispatch_forward_and_backward(dtype: torch.dtype, keys: int) -> None:
    """``attention_with_lse`` (out, lse; a fully hidden row gives 0 and -inf) and ``attention_with_lse_backward``
    given the final out/lse, on the efficient kernel, against fp64 math."""
    from runtime.sp.lse_attention import attention_with_lse, attention_with_lse_backward

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 48, 32, generator=g).to(CUDA, dtype)
    k, v = (torch.randn(2, 4, keys, 32, generator=g).to(CUDA, dtype) for _ in range(2))
    allowed = torch.rand(2, 1, 48, keys, generator=g).to(CUDA) < 0.7
    allowed[:, :, 5] = False  # a query that sees no key in this block
    scale = 32**-0.5
    out, lse = attention_with_lse(q, k, v, scale=scale, allowed=allowed)
    ref, ref_lse = _reference(q, k, v, scale, allowed)
    bound = 1e-5 if dtype == torch.float32 else BF16
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert rel(out, ref) < bound, rel(out, ref)
    seen = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), seen) and torch.count_nonzero(out[:, :, 5]) == 0
    assert rel(lse[seen], ref_lse[seen]) < bound
    # backward is given the *final* out/lse of the whole attention, finite for every row (each query sees a key)
    allowed[:, :, 5, :3] = True
    out, lse = attention_with_lse(q, k, v, scale=scale, allowed=allowed)
    grad = torch.randn(q.shape, generator=g).to(CUDA, dtype)
    dq, dk, dv = attention_with_lse_backward(grad, q, k, v, out, lse, scale=scale, allowed=allowed)
    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    scores = (leaves[0] @ leaves[1].transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    probs = scores.softmax(-1)
    ref_grads = torch.autograd.grad(probs @ leaves[2], leaves, grad.double())
    for name, a, b in zip("qkv", (dq, dk, dv), ref_grads, strict=True):
        assert rel(a, b) < bound * 2, (name, rel(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dit_ring_key_masks_on_the_efficient_kernel(dtype: torch.dtype) -> None:
    """Ring attention's no-ring path with padding keys (``kv_valid``) and padded text keys (``extra_valid``), the
    masks the DiT ring dispatch builds, on the efficient kernel (tests/dit/test_ring.py checks it on CPU)."""
    from runtime.sp.ring import ring_attention

    g = torch.Generator().manual_seed(2)
    b, h, s, text, d, scale = 2, 4, 72, 24, 64, 0.125

    def rand(length: int) -> torch.Tensor:
        return torch.randn(b, h, length, d, generator=g).to(CUDA, dtype)

    q, k, v, text_k, text_v = rand(text + s), rand(s), rand(s), rand(text), rand(text)
    kv_valid = (torch.arange(s) < 60).view(1, 1, s).to(CUDA)  # the last 12 local keys are padding
    text_valid = torch.ones(b, text, dtype=torch.bool, device=CUDA)
    text_valid[1, -5:] = False
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = ring_attention(
            q, k, v, group=None, causal=False, scale=scale, extra_kv=(text_k, text_v), kv_valid=kv_valid,
            extra_valid=text_valid,
        )  # fmt: skip
    seen = torch.cat([text_valid, kv_valid[0].expand(b, s)], 1)[:, None, None, :]
    keys, values = torch.cat([text_k, k], 2), torch.cat([text_v, v], 2)
    expected, _ = _reference(q, keys, values, scale, seen)
    assert rel(out, expected) < (1e-5 if dtype == torch.float32 else BF16)
