"""Expert parallelism and the global load-balancing loss on gloo ranks, against single-process references.

One spawn per world size runs every scenario (spawning dominates the cost); the parent computes the references.
EP: each rank's output and its gradients (tokens, routing weights) match the single-process eager run on the
concatenation of the EP group's tokens, and each rank's expert-weight gradients match that run's slice of the
experts it owns — all within 1e-5 relative (norm-wise).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.moe import ep_experts_forward, experts_forward, global_load_balancing_loss, local_expert_range
from tests.dist_utils import run_distributed
from tests.tolerance import assert_within_rounding

pytestmark = pytest.mark.dist

E, K, H, INTER = 8, 2, 16, 8
TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if b.norm() == 0:
        return a.norm().item()
    return ((a - b).norm() / b.norm()).item()


def _rank_data(tokens: int, allowed: list[int], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    allowed_t = torch.tensor(allowed)
    rows = [allowed_t[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(tokens)]
    return {
        "hidden": torch.randn(tokens, H, generator=g),
        "index": torch.stack(rows) if rows else torch.zeros(0, K, dtype=torch.long),
        "weights": torch.rand(tokens, K, generator=g) + 0.1,
        "grad_out": torch.randn(tokens, H, generator=g),
    }


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * INTER, H, generator=g) * H**-0.5, torch.randn(E, H, INTER, generator=g) * INTER**-0.5


ALL = list(range(E))
# name -> (impl, per-rank (tokens, allowed experts)); with ep=2, rank 0 owns experts 0-3 and rank 1 owns 4-7.
EP2_CASES = {
    "random": ("grouped", [(7, ALL), (5, ALL)]),
    "random eager": ("eager", [(6, ALL), (9, ALL)]),
    # experts 1 (rank 0) and 5, 6 (rank 1) receive zero tokens from anyone
    "zero tokens for some experts": ("grouped", [(8, [0, 2, 3, 4, 7]), (6, [0, 3, 4, 7])]),
    # rank 1 routes only to its own experts: it sends nothing to rank 0
    "rank 1 sends nothing": ("grouped", [(6, ALL), (7, [4, 5, 6, 7])]),
    # everything goes to rank 1's experts: rank 0 receives nothing at all
    "rank 0 receives nothing": ("grouped", [(5, [4, 5, 6, 7]), (4, [5, 6, 7])]),
    # rank 1 has no tokens at all (sends nothing, receives some)
    "rank 1 has no tokens": ("grouped", [(9, ALL), (0, ALL)]),
    # the Triton kernels (Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1, which ranks inherit)
    "triton, expert 5 empty": ("triton", [(8, [0, 1, 2, 3, 4, 6, 7]), (6, [1, 2, 4, 6, 7])]),
}


def _ep_case(rank: int, ep_rank: int, ep_size: int, group, impl: str, data: dict, gate_up, down) -> dict:
    first, stop = local_expert_range(E, ep_size, ep_rank)
    hidden = data["hidden"].clone().requires_grad_(True)
    weights = data["weights"].clone().requires_grad_(True)
    local_gu = gate_up[first:stop].clone().requires_grad_(True)
    local_dn = down[first:stop].clone().requires_grad_(True)
    out = ep_experts_forward(hidden, data["index"], weights, local_gu, local_dn, F.silu, E, group, impl=impl)
    out.backward(data["grad_out"])
    zeros = torch.zeros_like  # eager leaves never-hit weights without a gradient
    return {
        "out": out.detach(),
        "d_hidden": hidden.grad,
        "d_weights": weights.grad,
        "d_gate_up": local_gu.grad if local_gu.grad is not None else zeros(local_gu),
        "d_down": local_dn.grad if local_dn.grad is not None else zeros(local_dn),
    }


def _world2(rank: int, world: int, cases: dict, weights: tuple, aux: dict) -> dict:
    gate_up, down = weights
    group = dist.new_group([0, 1])
    results: dict = {"ep": {}}
    for name, (impl, per_rank) in cases.items():
        results["ep"][name] = _ep_case(rank, rank, world, group, impl, per_rank[rank], gate_up, down)
    # Global load-balancing loss: two layers of logits from a replicated router weight.
    router = aux["router"].clone().requires_grad_(True)
    x = aux["x"][rank].clone().requires_grad_(True)
    logits = tuple(x @ router[layer].T for layer in range(router.size(0)))
    loss = global_load_balancing_loss(logits, aux["top_k"], E, group)
    loss.backward()
    results["aux"] = {"loss": loss.detach(), "d_x": x.grad, "d_router": router.grad}
    empty = torch.zeros(0, E, requires_grad=True) if rank == 1 else aux["x"][0][:, :E].clone().requires_grad_(True)
    results["aux_one_empty_rank"] = global_load_balancing_loss(empty, aux["top_k"], E, group).detach()
    return results


def _reference(per_rank: list[dict], gate_up, down, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Every rank's tokens through the eager experts in one process (``dtype=torch.float64``: the truth)."""
    cat = {k: torch.cat([d[k] for d in per_rank]) for k in per_rank[0]}
    inputs = (cat["hidden"], cat["weights"], gate_up, down)
    leaves = [t.to(dtype).clone().requires_grad_(True) for t in inputs]
    out = experts_forward(leaves[0], cat["index"], leaves[1], leaves[2], leaves[3], F.silu, "eager")
    out.backward(cat["grad_out"].to(dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _check_ep_group(name: str, per_rank: list[dict], results: list[dict], gate_up, down, ep_size: int) -> None:
    """Each EP rank's outputs and gradients within the rounding model (``tests.tolerance``) of the one-process run,
    its float64 run the truth."""
    refs = _reference(per_rank, gate_up, down)
    truths = _reference(per_rank, gate_up, down, torch.float64)
    start = 0
    for ep_rank, (data, got) in enumerate(zip(per_rank, results, strict=True)):
        stop = start + data["hidden"].size(0)
        first, last = local_expert_range(E, ep_size, ep_rank)
        rows = [slice(start, stop)] * 3 + [slice(first, last)] * 2
        names = ["out", "d_hidden", "d_weights", "d_gate_up", "d_down"]
        ref = {n: r[s] for n, r, s in zip(names, refs, rows, strict=True)}
        truth = {n: t[s] for n, t, s in zip(names, truths, rows, strict=True)}
        for n in names:
            assert got[n].shape == ref[n].shape, (name, ep_rank, n)
        assert_within_rounding({n: got[n] for n in names}, ref, truth, what=f"{name} ep rank {ep_rank}")
        start = stop


def _aux_inputs(seed: int, tokens: tuple[int, ...], layers: int = 2) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(layers, E, H, generator=g),
        "x": [torch.randn(t, H, generator=g) for t in tokens],
        "top_k": K,
    }


@pytest.fixture(scope="module")
def world2():
    per_rank = {
        name: (impl, [_rank_data(t, allowed, seed=100 + 10 * i + r) for r, (t, allowed) in enumerate(spec)])
        for i, (name, (impl, spec)) in enumerate(EP2_CASES.items())
    }
    weights = _weights(7)
    aux = _aux_inputs(8, (5, 11))
    return per_rank, weights, aux, run_distributed(_world2, 2, per_rank, weights, aux)


@pytest.mark.parametrize("name", list(EP2_CASES))
def test_ep2_matches_single_process(world2, name):
    per_rank, (gate_up, down), _, results = world2
    _check_ep_group(name, per_rank[name][1], [r["ep"][name] for r in results], gate_up, down, 2)


def test_ep2_zero_receiving_rank_has_zero_expert_grads(world2):
    _, _, _, results = world2
    got = results[0]["ep"]["rank 0 receives nothing"]
    assert torch.count_nonzero(got["d_gate_up"]) == 0 and torch.count_nonzero(got["d_down"]) == 0


def _aux_reference(aux: dict, dtype: torch.dtype) -> dict:
    """transformers' load-balancing loss of every rank's tokens in one process, and its gradients."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    router = aux["router"].to(dtype).clone().requires_grad_(True)
    xs = [x.to(dtype).clone().requires_grad_(True) for x in aux["x"]]
    x_cat = torch.cat(xs)
    loss = load_balancing_loss_func(tuple(x_cat @ router[layer].T for layer in range(router.size(0))), E, aux["top_k"])
    loss.backward()
    return {"loss": loss.detach(), "d_x": [x.grad for x in xs], "d_router": router.grad}


def test_global_aux_loss_parity(world2):
    """Within the rounding model (``tests.tolerance``), the float64 run the truth: each rank's loss and the
    gradient of its own tokens (complete), and the replicated router's gradients summed over the ranks."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    _, _, aux, results = world2
    ref, truth = _aux_reference(aux, torch.float32), _aux_reference(aux, torch.float64)
    for rank, got in enumerate(results):
        own = [{"loss": r["loss"], "d_x": r["d_x"][rank]} for r in (ref, truth)]
        assert_within_rounding({"loss": got["aux"]["loss"], "d_x": got["aux"]["d_x"]}, *own, what=f"rank {rank}")
    summed = {"d_router": results[0]["aux"]["d_router"] + results[1]["aux"]["d_router"]}
    assert_within_rounding(summed, {"d_router": ref["d_router"]}, {"d_router": truth["d_router"]})
    # A rank without tokens takes part and gets the same global value as the other rank.
    assert torch.equal(results[0]["aux_one_empty_rank"], results[1]["aux_one_empty_rank"])
    single = [
        load_balancing_loss_func((aux["x"][0][:, :E].to(d),), E, aux["top_k"]) for d in (torch.float32, torch.float64)
    ]
    assert_within_rounding({"loss": results[0]["aux_one_empty_rank"]}, *({"loss": x} for x in single))


def _world4(rank: int, world: int, per_rank: list[dict], weights: tuple) -> dict:
    from runtime.parallel.state import init_parallel_state

    state = init_parallel_state(ep_size=2)
    assert (state.ep_size, state.ep_rank) == (2, rank % 2)
    gate_up, down = weights
    return _ep_case(rank, state.ep_rank, state.ep_size, state.ep_group, "grouped", per_rank[rank], gate_up, down)


def test_ep2_in_two_groups_at_world4():
    """World 4, ep=2 (ParallelState): EP groups [0, 1] and [2, 3] each match their own single-process run."""
    per_rank = [
        _rank_data(6, ALL, seed=300),
        _rank_data(5, [0, 1, 2, 3], seed=301),  # sends nothing to rank 1 of its group
        _rank_data(7, [1, 2, 3, 4, 7], seed=302),  # experts 0, 5, 6 unused in group [2, 3]
        _rank_data(0, ALL, seed=303),  # no tokens
    ]
    weights = _weights(9)
    results = run_distributed(_world4, 4, per_rank, weights)
    for first in (0, 2):
        _check_ep_group(f"group {first}", per_rank[first : first + 2], results[first : first + 2], *weights, 2)
