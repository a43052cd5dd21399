"""SP collectives against single-process references on the full tensor.

One spawned world of 2 gloo ranks runs every distributed scenario (``_world2_worker``) and returns what each rank
computed; the tests then assemble the ranks' outputs (concatenate chunks, sum partial gradients) and compare with the
same computation done on the full tensor in this process. Inputs come from fixed seeds so every process builds the
same tensors. Elementwise per-token functions keep the math identical, so most comparisons are bitwise; sums whose
order changes (parameter gradients, matmuls on different row counts) get tight tolerances.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from runtime.parallel.collectives import (
    gather_along_dim,
    gather_heads_scatter_seq,
    gather_heads_scatter_seq_many,
    gather_seq_scatter_heads,
    gather_seq_scatter_heads_many,
    pad_and_slice,
    reduce_token_weighted_loss,
    slice_for_rank,
    unpad,
)
from tests.dist_utils import run_distributed

WORLD = 2
CLOSE = {"rtol": 2e-6, "atol": 2e-6}
EXACT = {"rtol": 0.0, "atol": 0.0}


def _rand(seed: int, *shape: int) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _chunk(x: Tensor, dim: int, parts: int, index: int) -> Tensor:
    return x.tensor_split(parts, dim=dim)[index]


def _f(x: Tensor, w: Tensor) -> Tensor:
    """A nonlinear per-token function with a parameter; elementwise, so chunking never changes its values."""
    return torch.tanh(x * w + 0.5) * x


def _leaf(x: Tensor) -> Tensor:
    return x.detach().clone().requires_grad_()


# --- scenario tables (shared by the worker and the tests) -------------------------------------------------------

SLICE_CASES = {
    "bshd_seq": ((2, 6, 4, 3), 1),
    "bhsd_seq": ((2, 4, 6, 3), 2),
    "dim0": ((4, 3, 5), 0),
    "last_neg": ((2, 3, 4), -1),
}
GATHER_CASES = SLICE_CASES
# name -> (seq_len, multiple); shape is (2, seq_len, 3), padded along dim 1.
PAD_CASES = {
    "odd_len": (7, 1),
    "multiple": (7, 3),
    "last_rank_all_padding": (3, 4),
    "no_padding": (8, 1),
}
PAD_VALUE = 0.25
# name -> (shape, seq_dim, head_dim)
ULYSSES_CASES = {
    "bshd": ((2, 6, 4, 3), 1, 2),
    "bhsd": ((2, 4, 6, 3), 2, 1),
    "neg_dims_sbhd": ((6, 2, 4, 3), -4, -2),
}
# name -> labels (B=1, S=7); -100 is ignored. S=7 also exercises padding (rank 1 gets 3 tokens + 1 pad).
LOSS_CASES = {
    "uneven": [5, -100, 2, 7, 1, -100, 3],
    "rank1_no_tokens": [5, 1, 2, 7, -100, -100, -100],
    "no_tokens": [-100] * 7,
}
VOCAB, HIDDEN = 11, 5


def _weight_shape(shape: tuple[int, ...], keep: tuple[int, ...]) -> tuple[int, ...]:
    """A parameter broadcasting over ``shape`` that varies only along the dims in ``keep``."""
    keep = tuple(d % len(shape) for d in keep)
    return tuple(n if d in keep else 1 for d, n in enumerate(shape))


def _param(shape: tuple[int, ...], split_dim: int) -> Tensor:
    """A replicated parameter for ``_f`` that varies along the dim after the split one (so it needs no slicing)."""
    return _leaf(_rand(2, *_weight_shape(shape, ((split_dim % len(shape) + 1) % len(shape),))))


# --- distributed side ---------------------------------------------------------------------------------------------


def _dist_slice(rank: int, group: dist.ProcessGroup, shape: tuple[int, ...], dim: int) -> dict[str, Tensor]:
    x, w = _leaf(_rand(1, *shape)), _param(shape, dim)
    g = _rand(3, *shape)
    y = _f(slice_for_rank(x, dim, group), w)
    (y * _chunk(g, dim, WORLD, rank)).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad, "w_grad": w.grad}


def _dist_gather(rank: int, group: dist.ProcessGroup, shape: tuple[int, ...], dim: int) -> dict[str, Tensor]:
    local, w = _leaf(_chunk(_rand(1, *shape), dim, WORLD, rank)), _param(shape, dim)
    full = gather_along_dim(local, dim, group)
    # A different loss term per rank, so each rank's partial gradient of the gathered tensor differs.
    (_f(full, w) * _rand(100 + rank, *shape)).sum().backward()
    return {"full": full.detach(), "local_grad": local.grad, "w_grad": w.grad}


def _dist_pad(rank: int, group: dist.ProcessGroup, seq_len: int, multiple: int) -> dict[str, Tensor | int]:
    x, w = _leaf(_rand(1, 2, seq_len, 3)), _leaf(_rand(2, 3))
    local, pad_len = pad_and_slice(x, 1, group, multiple=multiple, value=PAD_VALUE)
    y = unpad(gather_along_dim(_f(local, w), 1, group), 1, pad_len)
    (y * _rand(100 + rank, 2, seq_len, 3)).sum().backward()
    return {"local": local.detach(), "pad_len": pad_len, "y": y.detach(), "x_grad": x.grad, "w_grad": w.grad}


def _dist_ulysses(
    rank: int, group: dist.ProcessGroup, shape: tuple[int, ...], seq_dim: int, head_dim: int
) -> dict[str, Tensor]:
    x_local = _leaf(_chunk(_rand(1, *shape), seq_dim, WORLD, rank))
    w = _leaf(_rand(2, *_weight_shape(shape, (head_dim, -1))))
    heads = gather_seq_scatter_heads(x_local, seq_dim, head_dim, group)
    out = gather_heads_scatter_seq(_f(heads, slice_for_rank(w, head_dim, group)), head_dim, seq_dim, group)
    (out * _chunk(_rand(3, *shape), seq_dim, WORLD, rank)).sum().backward()
    return {"heads": heads.detach(), "out": out.detach(), "x_grad": x_local.grad, "w_grad": w.grad}


def _attention_inputs() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    b, s, h, d = 2, 8, 4, 5  # (batch, seq, heads, head_dim), the layout HF projections produce
    return _rand(11, b, s, h, d), _rand(12, b, s, h, d), _rand(13, b, s, h, d), _rand(14, b, s, h, d)


def _sdpa_bshd(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def _dist_attention(rank: int, group: dist.ProcessGroup) -> dict[str, Tensor]:
    """Ulysses as used for real: causal attention over the full sequence on this rank's heads."""
    *qkv, g = _attention_inputs()
    q, k, v = (_leaf(_chunk(t, 1, WORLD, rank)) for t in qkv)
    heads = [gather_seq_scatter_heads(t, 1, 2, group) for t in (q, k, v)]
    out = gather_heads_scatter_seq(_sdpa_bshd(*heads), 2, 1, group)
    (out * _chunk(g, 1, WORLD, rank)).sum().backward()
    return {"out": out.detach(), "q_grad": q.grad, "k_grad": k.grad, "v_grad": v.grad}


# q, k, v of one attention call (b, s, h, d): GQA head counts and a value head dim of its own; full sequence 6
MANY_SHAPES = ((2, 6, 4, 5), (2, 6, 2, 5), (2, 6, 2, 7))


def _dist_many(rank: int, group: dist.ProcessGroup, fused: bool) -> dict[str, object]:
    """q, k, v to heads and back, in one all-to-all each way (``fused``) or one per tensor; the outputs, the
    gradients of the inputs, and the all-to-alls issued."""
    xs = [_leaf(_chunk(_rand(40 + i, *shape), 1, WORLD, rank)) for i, shape in enumerate(MANY_SHAPES)]
    calls, issue = [], dist.all_to_all_single

    def counted(*args, **kwargs):
        calls.append(1)
        return issue(*args, **kwargs)

    dist.all_to_all_single = counted
    try:
        if fused:
            heads = gather_seq_scatter_heads_many(xs, 1, 2, group)
            back = gather_heads_scatter_seq_many([torch.tanh(h) * (i + 2) for i, h in enumerate(heads)], 2, 1, group)
        else:
            heads = [gather_seq_scatter_heads(x, 1, 2, group) for x in xs]
            back = [gather_heads_scatter_seq(torch.tanh(h) * (i + 2), 2, 1, group) for i, h in enumerate(heads)]
        sum((b * _rand(50 + i, *b.shape)).sum() for i, b in enumerate(back)).backward()
    finally:
        dist.all_to_all_single = issue
    return {
        "heads": [h.detach() for h in heads],
        "back": [b.detach() for b in back],
        "grads": [x.grad for x in xs],
        "calls": len(calls),
        "grad_fn": type(heads[0].grad_fn).__name__,
    }


def _loss_inputs(labels: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    return _rand(21, 1, len(labels), HIDDEN), _rand(22, HIDDEN, VOCAB), torch.tensor([labels])


def _dist_loss(rank: int, group: dist.ProcessGroup, labels: list[int]) -> dict[str, Tensor | int]:
    hidden, weight, label_t = _loss_inputs(labels)
    hidden, weight = _leaf(hidden), _leaf(weight)
    h_local, _ = pad_and_slice(hidden, 1, group)
    y_local, _ = pad_and_slice(label_t, 1, group, value=-100)
    logits = h_local @ weight
    loss_sum = F.cross_entropy(logits.flatten(0, 1), y_local.flatten(), ignore_index=-100, reduction="sum")
    count = (y_local != -100).sum()
    loss = reduce_token_weighted_loss(loss_sum, count, group)
    loss.backward()
    return {"loss": loss.detach(), "count": int(count), "h_grad": hidden.grad, "w_grad": weight.grad}


def _dist_loss_scalar(rank: int, group: dist.ProcessGroup) -> dict[str, Tensor]:
    """Python-int counts, rank 1 without tokens: global mean = (s0 + s1) / 3, gradient 1/3 on both ranks."""
    loss_sum = _leaf(_rand(30 + rank, 1).reshape(()))
    loss = reduce_token_weighted_loss(loss_sum, [3, 0][rank], group)
    loss.backward()
    return {"loss": loss.detach(), "grad": loss_sum.grad}


def _error_message(fn, *args) -> str:
    try:
        fn(*args)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _dist_errors(rank: int, group: dist.ProcessGroup) -> dict[str, str]:
    # These must fail on every rank before any communication, so the world stays usable afterwards.
    return {
        "heads": _error_message(gather_seq_scatter_heads, _rand(0, 2, 4, 3, 8), 1, 2, group),
        "seq": _error_message(gather_heads_scatter_seq, _rand(0, 2, 5, 2, 8), 2, 1, group),
        "slice": _error_message(slice_for_rank, _rand(0, 2, 5), 1, group),
        "multiple": _error_message(pad_and_slice, _rand(0, 2, 5), 1, group, 0),
    }


def _world2_worker(rank: int, world_size: int) -> dict[str, object]:
    group = dist.new_group(list(range(world_size)))  # a real subgroup, like the mesh's sp group
    out: dict[str, object] = {}
    for name, (shape, dim) in SLICE_CASES.items():
        out[f"slice/{name}"] = _dist_slice(rank, group, shape, dim)
    for name, (shape, dim) in GATHER_CASES.items():
        out[f"gather/{name}"] = _dist_gather(rank, group, shape, dim)
    for name, (seq_len, multiple) in PAD_CASES.items():
        out[f"pad/{name}"] = _dist_pad(rank, group, seq_len, multiple)
    for name, (shape, seq_dim, head_dim) in ULYSSES_CASES.items():
        out[f"ulysses/{name}"] = _dist_ulysses(rank, group, shape, seq_dim, head_dim)
    out["attention"] = _dist_attention(rank, group)
    out["many"] = {fused: _dist_many(rank, group, fused) for fused in (False, True)}
    for name, labels in LOSS_CASES.items():
        out[f"loss/{name}"] = _dist_loss(rank, group, labels)
    out["loss_scalar"] = _dist_loss_scalar(rank, group)
    out["errors"] = _dist_errors(rank, group)
    # After the expected errors the group must still work.
    out["after_errors"] = gather_along_dim(torch.full((1,), float(rank)), 0, group)
    return out


@pytest.fixture(scope="module")
def world2() -> list[dict[str, object]]:
    return run_distributed(_world2_worker, WORLD)


def _ranks(world2: list[dict[str, object]], key: str) -> list[dict]:
    return [r[key] for r in world2]


# --- the comparisons --------------------------------------------------------------------------------------------


@pytest.mark.dist
@pytest.mark.parametrize("name", SLICE_CASES)
def test_slice_for_rank(world2, name):
    shape, dim = SLICE_CASES[name]
    ranks = _ranks(world2, f"slice/{name}")
    x, w = _leaf(_rand(1, *shape)), _param(shape, dim)
    y = _f(x, w)
    (y * _rand(3, *shape)).sum().backward()

    torch.testing.assert_close(torch.cat([r["y"] for r in ranks], dim), y.detach(), **EXACT)
    for rank, r in enumerate(ranks):  # partial gradient: zero outside this rank's chunk
        others = [i for i in range(WORLD) if i != rank]
        assert all((_chunk(r["x_grad"], dim, WORLD, i) == 0).all() for i in others)
    torch.testing.assert_close(sum(r["x_grad"] for r in ranks), x.grad, **EXACT)
    torch.testing.assert_close(sum(r["w_grad"] for r in ranks), w.grad, **CLOSE)


@pytest.mark.dist
@pytest.mark.parametrize("name", GATHER_CASES)
def test_gather_along_dim(world2, name):
    shape, dim = GATHER_CASES[name]
    ranks = _ranks(world2, f"gather/{name}")
    x, w = _leaf(_rand(1, *shape)), _param(shape, dim)
    y = _f(x, w)
    sum((y * _rand(100 + rank, *shape)).sum() for rank in range(WORLD)).backward()

    for r in ranks:
        torch.testing.assert_close(r["full"], x.detach(), **EXACT)
    # Each rank's chunk gradient must already be complete (reduce-scattered), so concatenation gives the total.
    torch.testing.assert_close(torch.cat([r["local_grad"] for r in ranks], dim), x.grad, **CLOSE)
    torch.testing.assert_close(sum(r["w_grad"] for r in ranks), w.grad, **CLOSE)


@pytest.mark.dist
@pytest.mark.parametrize("name", PAD_CASES)
def test_pad_and_slice_roundtrip(world2, name):
    seq_len, multiple = PAD_CASES[name]
    ranks = _ranks(world2, f"pad/{name}")
    x, w = _leaf(_rand(1, 2, seq_len, 3)), _leaf(_rand(2, 3))
    y = _f(x, w)
    sum((y * _rand(100 + rank, 2, seq_len, 3)).sum() for rank in range(WORLD)).backward()

    padded_len = -(-seq_len // (WORLD * multiple)) * WORLD * multiple
    padded = torch.cat([x.detach(), torch.full((2, padded_len - seq_len, 3), PAD_VALUE)], dim=1)
    for rank, r in enumerate(ranks):
        assert r["pad_len"] == padded_len - seq_len
        torch.testing.assert_close(r["local"], _chunk(padded, 1, WORLD, rank), **EXACT)
        torch.testing.assert_close(r["y"], y.detach(), **EXACT)
    torch.testing.assert_close(sum(r["x_grad"] for r in ranks), x.grad, **EXACT)
    torch.testing.assert_close(sum(r["w_grad"] for r in ranks), w.grad, **CLOSE)


@pytest.mark.dist
@pytest.mark.parametrize("name", ULYSSES_CASES)
def test_ulysses_all_to_all(world2, name):
    shape, seq_dim, head_dim = ULYSSES_CASES[name]
    ranks = _ranks(world2, f"ulysses/{name}")
    x, w = _leaf(_rand(1, *shape)), _leaf(_rand(2, *_weight_shape(shape, (head_dim, -1))))
    y = _f(x, w)
    (y * _rand(3, *shape)).sum().backward()

    for rank, r in enumerate(ranks):
        # Full sequence, this rank's contiguous head chunk.
        torch.testing.assert_close(r["heads"], _chunk(x.detach(), head_dim, WORLD, rank), **EXACT)
        torch.testing.assert_close(r["out"], _chunk(y.detach(), seq_dim, WORLD, rank), **EXACT)
    torch.testing.assert_close(torch.cat([r["x_grad"] for r in ranks], seq_dim), x.grad, **EXACT)
    torch.testing.assert_close(sum(r["w_grad"] for r in ranks), w.grad, **CLOSE)


@pytest.mark.dist
def test_ulysses_causal_attention(world2):
    ranks = _ranks(world2, "attention")
    *qkv, g = _attention_inputs()
    q, k, v = (_leaf(t) for t in qkv)
    out = _sdpa_bshd(q, k, v)
    (out * g).sum().backward()

    torch.testing.assert_close(torch.cat([r["out"] for r in ranks], 1), out.detach(), **CLOSE)
    for key, ref in (("q_grad", q.grad), ("k_grad", k.grad), ("v_grad", v.grad)):
        torch.testing.assert_close(torch.cat([r[key] for r in ranks], 1), ref, **CLOSE)


@pytest.mark.dist
def test_fused_all_to_all_is_bitwise_the_one_per_tensor(world2):
    """q, k and v (differing head counts and head dims) in one all-to-all each way, forward and backward: the
    elements of every output and input gradient are bitwise those of one all-to-all per tensor."""
    for rank, r in enumerate(_ranks(world2, "many")):
        apart, fused = r[False], r[True]
        assert (apart["calls"], fused["calls"]) == (12, 4), rank  # 3 + 3 forward and backward, against 1 + 1
        assert fused["grad_fn"] == "_FusedAllToAllBackward", rank
        for key in ("heads", "back", "grads"):
            assert all(torch.equal(a, f) for a, f in zip(apart[key], fused[key], strict=True)), (rank, key)
        full = [_rand(40 + i, *shape) for i, shape in enumerate(MANY_SHAPES)]
        for heads, x in zip(fused["heads"], full, strict=True):  # full sequence, this rank's head chunk
            assert torch.equal(heads, _chunk(x, 2, WORLD, rank)), rank


@pytest.mark.dist
@pytest.mark.parametrize("name", LOSS_CASES)
def test_token_weighted_loss(world2, name):
    labels = LOSS_CASES[name]
    ranks = _ranks(world2, f"loss/{name}")
    hidden, weight, label_t = _loss_inputs(labels)
    hidden, weight = _leaf(hidden), _leaf(weight)
    if any(label != -100 for label in labels):
        loss = F.cross_entropy((hidden @ weight).flatten(0, 1), label_t.flatten(), ignore_index=-100)
    else:  # the reference mean is NaN here; the contract is 0 with zero gradients
        loss = (hidden @ weight).sum() * 0
    loss.backward()

    assert sum(r["count"] for r in ranks) == sum(label != -100 for label in labels)
    if name == "rank1_no_tokens":
        assert ranks[1]["count"] == 0
    for r in ranks:
        assert torch.isfinite(r["loss"])
        torch.testing.assert_close(r["loss"], loss.detach(), **CLOSE)
    torch.testing.assert_close(sum(r["h_grad"] for r in ranks), hidden.grad, **CLOSE)
    torch.testing.assert_close(sum(r["w_grad"] for r in ranks), weight.grad, **CLOSE)


@pytest.mark.dist
def test_token_weighted_loss_backward_has_no_communication(world2):
    ranks = _ranks(world2, "loss_scalar")
    s0, s1 = (_rand(30 + rank, 1).reshape(()) for rank in range(WORLD))
    for r in ranks:
        torch.testing.assert_close(r["loss"], (s0 + s1) / 3, **CLOSE)
        torch.testing.assert_close(r["grad"], torch.tensor(1 / 3), **EXACT)


@pytest.mark.dist
@pytest.mark.parametrize(
    "key, pattern",
    [
        ("heads", r"gather_seq_scatter_heads \(heads\): dim 2 .* shape \(2, 4, 3, 8\) has size 3, .* group size 2"),
        ("seq", r"gather_heads_scatter_seq \(sequence\): dim 1 .* has size 5, .* group size 2"),
        ("slice", r"slice_for_rank: dim 1 .* has size 5, .* group size 2"),
        ("multiple", r"multiple must be >= 1, got 0"),
    ],
)
def test_error_messages(world2, key, pattern):
    for r in world2:
        message = r["errors"][key]
        assert "\n" not in message
        assert re.search(pattern, message), message


@pytest.mark.dist
def test_group_still_usable_after_errors(world2):
    for r in world2:
        torch.testing.assert_close(r["after_errors"], torch.tensor([0.0, 1.0]), **EXACT)


# --- single process: group=None is free -------------------------------------------------------------------------


def test_group_none_is_identity():
    x = _rand(1, 2, 5, 3)
    assert slice_for_rank(x, 1, None) is x
    assert gather_along_dim(x, 1, None) is x
    assert gather_seq_scatter_heads(x, 1, 2, None) is x
    assert gather_heads_scatter_seq(x, 2, 1, None) is x
    local, pad_len = pad_and_slice(x, 1, None)
    assert local is x and pad_len == 0
    assert unpad(x, 1, 0) is x


def test_group_none_pads_to_multiple():
    x = _leaf(_rand(1, 2, 5, 3))
    local, pad_len = pad_and_slice(x, -2, None, multiple=4, value=-1.0)
    assert pad_len == 3 and local.shape == (2, 8, 3)
    assert (local[:, 5:] == -1.0).all()
    back = unpad(local, -2, pad_len)
    torch.testing.assert_close(back, x.detach(), **EXACT)
    back.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x), **EXACT)


def test_pad_and_slice_integer_labels():
    labels = torch.tensor([[3, 1, 4]])
    padded, pad_len = pad_and_slice(labels, 1, None, multiple=4, value=-100)
    assert pad_len == 1 and padded.dtype == torch.int64
    assert padded.tolist() == [[3, 1, 4, -100]]


def test_reduce_token_weighted_loss_single_process():
    loss_sum = _leaf(torch.tensor(6.0))
    loss = reduce_token_weighted_loss(loss_sum, torch.tensor(4, dtype=torch.int32), None)
    loss.backward()
    assert loss.item() == 1.5 and loss_sum.grad.item() == 0.25

    loss_sum = _leaf(torch.tensor(6.0))
    loss = reduce_token_weighted_loss(loss_sum, 0, None)
    loss.backward()
    assert loss.item() == 0.0 and loss_sum.grad.item() == 0.0


def test_reduce_token_weighted_loss_rejects_non_scalars():
    with pytest.raises(ValueError, match="loss_sum must be a scalar"):
        reduce_token_weighted_loss(torch.ones(2), 2, None)
    with pytest.raises(ValueError, match="token_count must be a scalar"):
        reduce_token_weighted_loss(torch.tensor(1.0), torch.tensor([1, 2]), None)
