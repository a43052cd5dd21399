"""Ring attention against plain full-sequence SDPA (the reference, one process): outputs and q/k/v gradients at
ring 2 and 4, causal and not, packed documents straddling chunk edges, contiguous and zigzag layouts, GQA, a
replicated extra K/V segment (DiT joint attention) and an uneven length padded with its own padding segment."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from runtime.sp.layout import zigzag_indices
from runtime.sp.lse_attention import attention_with_lse, merge_partials
from runtime.sp.ring import contiguous_indices, ring_attention
from tests.dist_utils import run_distributed

B, HQ, D = 2, 4, 8

# name: (length, real tokens, kv heads, causal, documents, layout, extra tokens, dtype)
CASES = {
    "causal_docs": (16, 16, 4, True, [5, 7, 4], "contiguous", 0, torch.float64),
    "causal_docs_zigzag_gqa": (16, 16, 2, True, [3, 9, 4], "zigzag", 0, torch.float64),
    "bidirectional_docs": (16, 16, 4, False, [6, 10], "contiguous", 0, torch.float64),
    "joint_extra_kv": (16, 16, 1, False, None, "contiguous", 3, torch.float64),
    "uneven_padded_fp32": (16, 13, 4, True, [6, 7], "contiguous", 0, torch.float32),
}
WINDOW = {"causal_docs_zigzag_gqa": 5}  # a sliding window (transformers' rule: key > query - window)


def _docs(case: str) -> torch.Tensor | None:
    length, real, _, _, lengths, *_ = CASES[case]
    if lengths is None:
        return None
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((length - real,), 99)])
    return torch.stack([ids, ids.roll(3)])  # two rows with different boundaries


def _inputs(case: str) -> dict[str, torch.Tensor]:
    length, _, hkv, _, _, _, extra, dtype = CASES[case]
    g = torch.Generator().manual_seed(0)
    x = {
        name: torch.randn(B, h, length, D, generator=g, dtype=dtype) for name, h in (("q", HQ), ("k", hkv), ("v", hkv))
    }
    x["grad"] = torch.randn(B, HQ, length, D, generator=g, dtype=dtype)
    if extra:
        x["ek"] = torch.randn(B, hkv, extra, D, generator=g, dtype=dtype)
        x["ev"] = torch.randn(B, hkv, extra, D, generator=g, dtype=dtype)
    return x


def _reference(case: str) -> dict[str, torch.Tensor]:
    """Full-sequence SDPA with the dense mask, in float64."""
    length, real, hkv, causal, _, _, extra, _ = CASES[case]
    x = {k: t.double().requires_grad_() for k, t in _inputs(case).items() if k != "grad"}
    docs = _docs(case)
    allowed = torch.ones(B, 1, length, length, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(length, length, dtype=torch.bool).tril()
    if case in WINDOW:
        allowed &= torch.ones(length, length, dtype=torch.bool).triu(1 - WINDOW[case])
    if docs is not None:
        allowed &= (docs[:, :, None] == docs[:, None, :])[:, None]
    k, v = x["k"].repeat_interleave(HQ // hkv, 1), x["v"].repeat_interleave(HQ // hkv, 1)
    if extra:
        k = torch.cat([x["ek"].repeat_interleave(HQ // hkv, 1), k], 2)
        v = torch.cat([x["ev"].repeat_interleave(HQ // hkv, 1), v], 2)
        allowed = torch.cat([torch.ones(B, 1, length, extra, dtype=torch.bool), allowed], -1)
    out = torch.nn.functional.scaled_dot_product_attention(x["q"], k, v, attn_mask=allowed)
    grad = _inputs(case)["grad"].double()
    grad[:, :, real:] = 0  # padding tokens carry no loss
    (out * grad).sum().backward()
    return {"out": out.detach(), **{f"d{k}": t.grad for k, t in x.items()}}


def _worker(rank: int, world_size: int, case: str) -> dict[str, torch.Tensor]:
    length, real, _, causal, _, layout, extra, _ = CASES[case]
    split = zigzag_indices if layout == "zigzag" else contiguous_indices
    index = torch.stack([split(length, world_size, r) for r in range(world_size)])
    mine = index[rank]
    full = _inputs(case)
    local = {k: full[k][:, :, mine].clone().requires_grad_() for k in ("q", "k", "v")}
    extra_kv = None
    if extra:
        extra_kv = (full["ek"].clone().requires_grad_(), full["ev"].clone().requires_grad_())
    docs = _docs(case)
    doc_ids = None if docs is None else torch.stack([docs[:, i] for i in index])
    out = ring_attention(
        local["q"],
        local["k"],
        local["v"],
        group=dist.group.WORLD,
        causal=causal,
        scale=D**-0.5,
        index=index,
        doc_ids=doc_ids,
        extra_kv=extra_kv,
        window=WINDOW.get(case),
    )
    grad = full["grad"].clone()
    grad[:, :, real:] = 0
    (out * grad[:, :, mine]).sum().backward()
    result = {"index": mine, "out": out.detach(), **{f"d{k}": t.grad for k, t in local.items()}}
    if extra:
        for name, t in zip(("dek", "dev"), extra_kv, strict=True):
            summed = t.grad.clone()
            dist.all_reduce(summed)  # each rank's queries' part of the replicated segment's gradient
            result[name] = summed
    return result


@pytest.mark.dist
@pytest.mark.parametrize(
    "case, world",
    [*((case, 2) for case in CASES), ("causal_docs_zigzag_gqa", 4), ("uneven_padded_fp32", 4)],  # world 4: slow ranks
)
def test_ring_matches_full_attention(case, world):
    ref = _reference(case)
    real = CASES[case][1]
    tol = 1e-10 if CASES[case][-1] == torch.float64 else 1e-5
    for r in run_distributed(_worker, world, case):
        keep = r["index"] < real
        for name in ("out", "dq", "dk", "dv"):
            got, want = r[name][:, :, keep].double(), ref[name][:, :, r["index"][keep]]
            assert torch.allclose(got, want, atol=tol, rtol=0), (name, (got - want).abs().max())
        for name in ("dek", "dev"):
            if name in r:
                assert torch.allclose(r[name].double(), ref[name], atol=tol, rtol=0), name


def test_merge_partials_equals_attention_over_the_union():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    allowed = torch.rand(5, 5, generator=g) > 0.4
    allowed[:, 0] = True
    allowed[2, 3:] = False  # a row that sees nothing in the second block
    a, b = slice(0, 3), slice(3, 5)
    out_a, lse_a = attention_with_lse(q, k[:, :, a], v[:, :, a], scale=0.5, allowed=allowed[:, a])
    out_b, lse_b = attention_with_lse(q, k[:, :, b], v[:, :, b], scale=0.5, allowed=allowed[:, b])
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    s = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~allowed, float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-12)
    assert torch.allclose(out, torch.softmax(s, -1) @ v, atol=1e-12)


def test_zigzag_balances_causal_work():
    # pairs (query, key) with key <= query per rank: equal under zigzag, 1:3:5:7 under contiguous chunks
    def work(split):
        return [
            int((i[None, :] <= i[:, None]).sum() + sum((j[None, :] <= i[:, None]).sum() for j in others))
            for i, others in ((split(32, 4, r), [split(32, 4, o) for o in range(4) if o != r]) for r in range(4))
        ]

    assert len(set(work(zigzag_indices))) == 1
    assert work(contiguous_indices) == sorted(work(contiguous_indices)) and len(set(work(contiguous_indices))) == 4
