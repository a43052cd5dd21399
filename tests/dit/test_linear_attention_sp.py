"""``runtime/diffusion/sp_linear.py`` at 2 gloo ranks against one process: Sana's linear attention (ReLU feature maps,
a row of ones appended to V, the kernel sums over every key) on 7 tokens split 4 + 3 (+1 padding key holding garbage,
zeroed), the outputs of each rank's queries and the gradients of q, k and v. The sums are the same products added in
another order: 1e-10 relative in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed

B, H, S, D = 2, 3, 7, 4


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, H * D, dtype=torch.float64, generator=g) for _ in range(3))
    return q, k, v, torch.randn(B, S, H * D, dtype=torch.float64, generator=g)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv) -> torch.Tensor:
    """SanaLinearAttnProcessor2_0's core, with ``kv(value, key)`` for its ``torch.matmul(value, key)``."""
    q = F.relu(q.transpose(1, 2).unflatten(1, (H, -1)))
    k = F.relu(k.transpose(1, 2).unflatten(1, (H, -1)).transpose(2, 3))
    v = F.pad(v.transpose(1, 2).unflatten(1, (H, -1)), (0, 0, 0, 1), mode="constant", value=1.0)
    out = torch.matmul(kv(v, k), q)
    return (out[:, :, :-1] / (out[:, :, -1:] + 1e-15)).flatten(1, 2).transpose(1, 2)


def _reference() -> dict:
    q, k, v, target = (t.requires_grad_(i < 3) for i, t in enumerate(_inputs()))
    out = _attend(q, k, v, torch.matmul)
    (out * target).sum().backward()
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def linear_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from runtime.diffusion.sp_linear import linear_attention_kv

    local = -(-S // world)
    pad = local * world - S
    full = [torch.cat([t, t.new_full((B, pad, H * D), 5.0)], 1) for t in _inputs()]
    q, k, v, target = (
        t[:, rank * local : (rank + 1) * local].clone().requires_grad_(i < 3) for i, t in enumerate(full)
    )
    valid = max(0, min(local, S - rank * local))
    out = _attend(q, k, v, lambda value, key: linear_attention_kv(value, key, valid, dist.group.WORLD))
    (out[:, :valid] * target[:, :valid]).sum().backward()
    return {"out": out.detach()[:, :valid], "q": q.grad[:, :valid], "k": k.grad[:, :valid], "v": v.grad[:, :valid]}


@pytest.mark.dist
def test_linear_attention_sp2_matches_one_process() -> None:
    per_rank = run_distributed(linear_worker, 2, timeout=300)
    ref = _reference()
    for key in ("out", "q", "k", "v"):
        got = torch.cat([rank[key] for rank in per_rank], 1)
        assert torch.allclose(got, ref[key], rtol=1e-10, atol=1e-14), key
