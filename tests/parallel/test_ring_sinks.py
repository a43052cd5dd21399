"""Ring attention with attention sinks (gpt_oss's ``s_aux``: one learned logit per query head in the softmax
denominator) against full attention with the sink as an extra softmax column (upstream's eager rule), in float64:
outputs and the q/k/v and sink gradients at ring 2, causal with packed documents and a sliding window, GQA, zigzag.
Float64 makes the bound (1e-10) a statement about the algebra, not about one CPU's rounding."""

from __future__ import annotations

import pytest
import torch

from runtime.sp.layout import zigzag_indices
from runtime.sp.ring import ring_attention
from tests.dist_utils import run_distributed

B, HQ, HKV, L, D = 2, 4, 2, 16, 8
DOCS = [5, 7, 4]
WINDOW = 5


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = {n: torch.randn(B, h, L, D, generator=g, dtype=torch.float64) for n, h in (("q", HQ), ("k", HKV), ("v", HKV))}
    x["grad"] = torch.randn(B, HQ, L, D, generator=g, dtype=torch.float64)
    x["sink"] = torch.randn(HQ, generator=g, dtype=torch.float64) * 2
    return x


def _docs() -> torch.Tensor:
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(DOCS)])
    return torch.stack([ids, ids.roll(3)])


def _allowed(window: int | None) -> torch.Tensor:
    allowed = torch.ones(L, L, dtype=torch.bool).tril()[None, None].expand(B, 1, L, L).clone()
    if window is not None:
        allowed &= torch.ones(L, L, dtype=torch.bool).triu(1 - window)
    docs = _docs()
    return allowed & (docs[:, :, None] == docs[:, None, :])[:, None]


def _reference(window: int | None) -> dict[str, torch.Tensor]:
    x = {k: t.clone().requires_grad_() for k, t in _inputs().items() if k != "grad"}
    k, v = (x[n].repeat_interleave(HQ // HKV, 1) for n in ("k", "v"))
    logits = (x["q"] @ k.transpose(-1, -2)) * D**-0.5
    logits = logits.masked_fill(~_allowed(window), float("-inf"))
    column = x["sink"][None, :, None, None].expand(B, HQ, L, 1)
    probs = torch.softmax(torch.cat([logits, column], -1), -1)[..., :-1]  # upstream's eager: the sink is dropped
    out = probs @ v
    (out * _inputs()["grad"]).sum().backward()
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in x.items()}}


def _worker(rank: int, world: int, window: int | None) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    index = torch.stack([zigzag_indices(L, world, r) for r in range(world)])
    mine = index[rank]
    full = _inputs()
    local = {n: full[n][:, :, mine].clone().requires_grad_() for n in ("q", "k", "v")}
    sink = full["sink"].clone().requires_grad_()
    docs = _docs()
    doc_ids = torch.stack([docs[:, i] for i in index])
    out = ring_attention(
        local["q"],
        local["k"],
        local["v"],
        group=dist.group.WORLD,
        causal=True,
        scale=D**-0.5,
        index=index,
        doc_ids=doc_ids,
        window=window,
        sink=sink,
    )
    (out * full["grad"][:, :, mine]).sum().backward()
    dist.all_reduce(sink.grad)  # each rank's queries give their part of the sink's gradient
    return {"mine": mine, "out": out.detach(), "dsink": sink.grad, **{f"d{n}": t.grad for n, t in local.items()}}


@pytest.mark.parametrize("window", [None, WINDOW])
def test_ring_with_sinks_matches_full_attention(window: int | None) -> None:
    ref = _reference(window)
    for r in run_distributed(_worker, 2, window):
        mine = r["mine"]
        for name in ("out", "dq", "dk", "dv"):
            assert torch.allclose(r[name], ref[name][:, :, mine], rtol=0, atol=1e-10), name
        assert torch.allclose(r["dsink"], ref["dsink"], rtol=0, atol=1e-10)


def test_local_path_with_sinks_matches_full_attention() -> None:
    """``group=None`` (no ring): the same rule over the local tokens."""
    ref = _reference(WINDOW)
    x = {k: t.clone().requires_grad_() for k, t in _inputs().items() if k != "grad"}
    docs = _docs()
    out = ring_attention(
        x["q"],
        x["k"],
        x["v"],
        group=None,
        causal=True,
        scale=D**-0.5,
        doc_ids=docs[None],
        window=WINDOW,
        sink=x["sink"],
    )
    (out * _inputs()["grad"]).sum().backward()
    assert torch.allclose(out, ref["out"], rtol=0, atol=1e-12)
    for n in ("q", "k", "v", "sink"):
        assert torch.allclose(x[n].grad, ref[f"d{n}"], rtol=0, atol=1e-12), n
