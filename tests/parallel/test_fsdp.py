"""FSDP2 (+SP, +HSDP) against the single-process run, activation checkpointing, grad-norm clipping, EP groups.

Every data-parallel replica gets a different packed row. The reference is one process running all rows packed into
one row with the plain mean loss (= the global token-weighted mean). The distributed ranks pass
``num_items_in_batch=<global valid-token count>`` so each rank's loss is its share and FSDP sums the partial
gradients. One spawn per world size (spawning costs seconds); the checks read the fixtures' results.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist

from runtime.models.registry import causal_lm_class
from runtime.models.tiny_configs import random_packed_batch, tiny_config
from runtime.parallel.fsdp import apply_activation_checkpointing, apply_fsdp, block_modules, clip_grad_norm_
from runtime.parallel.state import ParallelState, init_parallel_state, set_parallel_state
from runtime.sp.heads import check_sp_compatible
from tests.dist_utils import run_distributed
from tests.tolerance import assert_within_rounding

VOCAB = tiny_config("qwen3").vocab_size
MAX_NORM = 0.05  # below every case's gradient norm, so clipping really scales
# Packed rows, one per data-parallel replica; odd lengths so SP needs padding.
ROWS_2 = [(7, 10), (5, 9, 3)]
ROWS_4 = [(7, 10), (5, 9, 3), (11, 6), (4, 8, 2)]


@pytest.fixture(autouse=True)
def _reset_state():
    set_parallel_state(None)
    yield
    set_parallel_state(None)


def _model(seed: int = 0) -> torch.nn.Module:
    config = tiny_config("qwen3")
    torch.manual_seed(seed)
    return causal_lm_class("qwen3")(config)


def _rows(row_lengths: list[tuple[int, ...]]) -> list[dict[str, torch.Tensor]]:
    return [random_packed_batch(lengths, VOCAB, seed=100 + i) for i, lengths in enumerate(row_lengths)]


def _num_items(rows: list[dict[str, torch.Tensor]]) -> int:
    """Valid (shifted) targets over the whole global batch."""
    return sum(int((row["labels"][:, 1:] != -100).sum()) for row in rows)


def _reference(row_lengths: list[tuple[int, ...]], dtype: torch.dtype = torch.float32) -> dict[str, object]:
    """Single process: every row packed into one, plain mean loss; grads, grad norms and clipped grads
    (``dtype=torch.float64``: the truth of the rounding model)."""
    model = _model().to(dtype)
    rows = _rows(row_lengths)
    packed = {k: torch.cat([row[k] for row in rows], dim=1) for k in rows[0]}
    loss = model(**packed).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    inf_norm = max(g.abs().max() for g in grads.values())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    clipped = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"loss": loss.detach(), "grads": grads, "norm": norm, "inf_norm": inf_norm, "clipped": clipped}


# --- distributed workers ----------------------------------------------------------------------------------------


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _train_step(
    state: ParallelState,
    row_lengths: list[tuple[int, ...]],
    *,
    keep_grads: bool,
    activation_checkpointing: bool = False,
    composable_ac: bool = False,
) -> dict[str, object]:
    """One forward/backward of this rank's row under FSDP2: the global loss, the clip results and, if
    ``keep_grads``, the full gradients before and after clipping (every rank gathers; only keepers ship them)."""
    from runtime.data.sp_batch import shard_for_sp

    rows = _rows(row_lengths)
    model = _model()
    if composable_ac:
        apply_activation_checkpointing(model, prefer_hf=False)
    apply_fsdp(model, state, activation_checkpointing=activation_checkpointing)
    mlp_calls = [0]  # a block's MLP runs twice per step when the block is recomputed in backward
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: mlp_calls.__setitem__(0, mlp_calls[0] + 1))
    batch = shard_for_sp(rows[state.dp_rank], state)
    loss = model(**batch, num_items_in_batch=_num_items(rows)).loss
    loss.backward()
    # The SP loss value is already the SP group's share, so one rank per SP group contributes: sum over dp.
    total = loss.detach().clone()
    dist.all_reduce(total, group=state.dp_group)
    out: dict[str, object] = {
        "loss": total,
        "local_loss": loss.detach(),
        "mlp_calls": mlp_calls[0],
        "blocks_after_sharding": len(block_modules(model)),
    }  # FSDP renames the classes
    grads = _full_grads(model)
    params = list(model.parameters())
    # Mixed DTensor + plain gradients: a replicated plain parameter adds its norm to the total.
    extra = torch.nn.Parameter(torch.zeros(5))
    extra.grad = torch.arange(1.0, 6.0)
    out["mixed_norm"] = clip_grad_norm_([*params, extra], math.inf)
    out["inf_norm"] = clip_grad_norm_(params, math.inf, norm_type=math.inf)
    out["norm"] = clip_grad_norm_(params, MAX_NORM)
    clipped = _full_grads(model)
    if keep_grads:
        out["grads"], out["clipped"] = grads, clipped
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in b)


def _world2_worker(rank: int, world_size: int) -> dict[str, object]:
    state = init_parallel_state(dp_shard_size=2)
    plain = _train_step(state, ROWS_2, keep_grads=True)
    out: dict[str, object] = {"plain": plain, "fsdp_mesh_shape": tuple(state.fsdp_mesh.shape)}
    for key, kwargs in {"hf_ac": {"activation_checkpointing": True}, "composable_ac": {"composable_ac": True}}.items():
        got = _train_step(state, ROWS_2, keep_grads=True, **kwargs)  # compared here rather than shipped
        out[key] = {
            "loss_equal": torch.equal(got["loss"], plain["loss"]),
            "mlp_calls": got["mlp_calls"],
            "grad_diff": _max_diff(got["grads"], plain["grads"]),
        }
    if rank:  # rank 0's copy is enough
        del plain["grads"], plain["clipped"]
    return out


def _describe(state: ParallelState) -> dict[str, object]:
    ranks = dist.get_process_group_ranks
    return {
        "fsdp_shape": tuple(state.fsdp_mesh.shape),
        "fsdp_names": state.fsdp_mesh.mesh_dim_names,
        "fsdp_shard_ranks": ranks(state.fsdp_mesh.get_group("dp_shard_sp")),
        "fsdp_replicate_ranks": ranks(state.fsdp_mesh.get_group("dp_replicate")),
        "loss_ranks": ranks(state.loss_group),
        "ep": (state.ep_size, state.ep_enabled, state.ep_rank),
        "ep_ranks": None if state.ep_group is None else ranks(state.ep_group),
        "expert_fsdp_shape": tuple(state.expert_fsdp_mesh.shape),
        "expert_shard_ranks": ranks(state.expert_fsdp_mesh.get_group(1)),
    }


def _world4_worker(rank: int, world_size: int) -> dict[str, object]:
    out: dict[str, object] = {}
    state = init_parallel_state(dp_shard_size=2, sp_size=2)
    out["fsdp_sp"] = _train_step(state, ROWS_2, keep_grads=rank == 0)
    out["layout_fsdp_sp"] = _describe(state)
    state = init_parallel_state(dp_replicate_size=2, dp_shard_size=2)
    out["hsdp"] = _train_step(state, ROWS_4, keep_grads=rank == 0)
    out["layout_hsdp"] = _describe(state)
    out["layout_ep2_sp2"] = _describe(init_parallel_state(dp_shard_size=2, sp_size=2, ep_size=2))
    out["layout_ep4"] = _describe(init_parallel_state(dp_shard_size=4, ep_size=4))
    out["layout_ep2_hsdp"] = _describe(init_parallel_state(dp_replicate_size=2, dp_shard_size=2, ep_size=2))
    try:
        init_parallel_state(dp_shard_size=2, sp_size=2, ep_size=3)
        out["ep_error"] = "no error"
    except ValueError as exc:
        out["ep_error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def world2() -> list[dict[str, object]]:
    return run_distributed(_world2_worker, 2, timeout=240)


@pytest.fixture(scope="module")
def world4() -> list[dict[str, object]]:
    return run_distributed(_world4_worker, 4, timeout=300)


def _check_step(per_rank: list[dict[str, object]], key: str, row_lengths: list[tuple[int, ...]]) -> None:
    """Loss, norms, gradients and clipped gradients within the rounding model (``tests.tolerance``) of one process,
    its float64 run the truth; the mixed norm adds a non-FSDP tensor of norm^2 ``extra_sq``."""
    ref, truth = _reference(row_lengths), _reference(row_lengths, torch.float64)
    assert ref["norm"] > MAX_NORM  # the clip really scales
    results = [r[key] for r in per_rank]
    extra_sq = float(sum(i * i for i in range(1, 6)))
    for expected in (ref, truth):
        expected["mixed_norm"] = (expected["norm"] ** 2 + extra_sq).sqrt()
    keys = ["loss", "norm", "inf_norm", "mixed_norm", "grads", "clipped"]
    assert_within_rounding(results[0], ref, truth, keys, what=key)
    # Identical on every rank, bit for bit.
    for name in ("loss", "norm", "inf_norm", "mixed_norm"):
        assert all(torch.equal(r[name], results[0][name]) for r in results), (key, name)


# --- world size 2: FSDP over dp_shard=2 ---------------------------------------------------------------------------


@pytest.mark.dist
def test_fsdp2_matches_single_process(world2):
    assert all(r["fsdp_mesh_shape"] == (1, 2) and r["plain"]["blocks_after_sharding"] == 2 for r in world2)
    # The ranks really saw different rows: their shares differ.
    assert not torch.equal(world2[0]["plain"]["local_loss"], world2[1]["plain"]["local_loss"])
    _check_step(world2, "plain", ROWS_2)


@pytest.mark.dist
@pytest.mark.parametrize("variant", ["hf_ac", "composable_ac"])
def test_activation_checkpointing_changes_nothing_under_fsdp(world2, variant):
    for r in world2:
        assert r["plain"]["mlp_calls"] == 1 and r[variant]["mlp_calls"] == 2  # the block really was recomputed
        assert r[variant]["loss_equal"]
        assert r[variant]["grad_diff"] <= 1e-6, r[variant]["grad_diff"]


# --- world size 4: FSDP x SP and HSDP ----------------------------------------------------------------------------


@pytest.mark.dist
def test_fsdp2_x_sp_matches_single_process(world4):
    _check_step(world4, "fsdp_sp", ROWS_2)


@pytest.mark.dist
def test_hsdp_matches_single_process(world4):
    _check_step(world4, "hsdp", ROWS_4)


@pytest.mark.dist
def test_world4_meshes(world4):
    sp = [r["layout_fsdp_sp"] for r in world4]
    assert all(g["fsdp_shape"] == (1, 4) and g["fsdp_names"] == ("dp_replicate", "dp_shard_sp") for g in sp)
    assert all(g["fsdp_shard_ranks"] == [0, 1, 2, 3] and g["loss_ranks"] == [0, 1, 2, 3] for g in sp)
    assert all(g["ep"] == (1, False, 0) and g["ep_ranks"] is None and g["expert_fsdp_shape"] == (1, 4) for g in sp)
    hsdp = [r["layout_hsdp"] for r in world4]
    assert all(g["fsdp_shape"] == (2, 2) and g["loss_ranks"] == [0, 1, 2, 3] for g in hsdp)
    assert [g["fsdp_shard_ranks"] for g in hsdp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["fsdp_replicate_ranks"] for g in hsdp] == [[0, 2], [1, 3], [0, 2], [1, 3]]


@pytest.mark.dist
@pytest.mark.parametrize(
    "layout, ep_ranks, expert_shape, expert_shard_ranks",
    [
        # ep is the innermost part of dp_shard x sp: EP pairs are neighbours (here they coincide with the SP pairs),
        # and the experts are FSDP-sharded over the ranks holding the same experts (rank r and r + 2).
        ("layout_ep2_sp2", [[0, 1], [0, 1], [2, 3], [2, 3]], (1, 2), [[0, 2], [1, 3], [0, 2], [1, 3]]),
        ("layout_ep4", [[0, 1, 2, 3]] * 4, (1, 1), [[0], [1], [2], [3]]),
        # Experts live inside one replica: EP never crosses dp_replicate.
        ("layout_ep2_hsdp", [[0, 1], [0, 1], [2, 3], [2, 3]], (2, 1), [[0], [1], [2], [3]]),
    ],
)
def test_world4_ep_groups(world4, layout, ep_ranks, expert_shape, expert_shard_ranks):
    got = [r[layout] for r in world4]
    ep_size = len(ep_ranks[0])
    assert [g["ep"] for g in got] == [(ep_size, True, rank % ep_size) for rank in range(4)]
    assert [g["ep_ranks"] for g in got] == ep_ranks
    assert all(g["expert_fsdp_shape"] == expert_shape for g in got)
    assert [g["expert_shard_ranks"] for g in got] == expert_shard_ranks


@pytest.mark.dist
def test_world4_ep_that_does_not_divide_is_refused(world4):
    for r in world4:
        message = r["ep_error"]
        assert "\n" not in message and message.startswith("ep_size=3 must divide dp_shard_size x sp_size = 4"), message


# --- single process -----------------------------------------------------------------------------------------------


def test_single_process_state_has_no_fsdp_loss_or_ep_groups():
    state = ParallelState()
    assert state.fsdp_mesh is None and state.loss_mesh is None and state.ep_mesh is None
    assert state.loss_group is None and state.ep_group is None and state.expert_fsdp_mesh is None
    assert (state.ep_size, state.ep_enabled, state.ep_rank, state.fsdp_shard_size) == (1, False, 0, 1)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (
            {"world_size": 4, "dp_shard_size": 2, "sp_size": 2, "ep_size": 3},
            r"^ep_size=3 must divide dp_shard_size x sp_size = 4 .*world size 4$",
        ),
        (
            {"world_size": 4, "dp_replicate_size": 2, "dp_shard_size": 2, "ep_size": 4},
            r"^ep_size=4 must divide dp_shard_size x sp_size = 2 ",
        ),
        ({"world_size": 2, "dp_shard_size": 2, "ep_size": 0}, r"positive integers: .*ep_size=0"),
    ],
)
def test_state_rejects_impossible_ep(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        ParallelState(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "args, pattern",
    [
        ((6, 2, None, 4), r"6 attention heads cannot be split over sp=4"),
        ((12, 3, 128, 2), r"3 key/value heads cannot be split over sp=2"),
        ((8, 8, 3, 4), r"a sequence of 3 tokens cannot be split over sp=4"),
        ((8, 8, 16, 0), r"sp_size must be a positive integer"),
    ],
)
def test_check_sp_compatible_refuses(args, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        check_sp_compatible(*args)
    assert "\n" not in str(info.value)


def test_check_sp_compatible_returns_kv_repeat():
    assert check_sp_compatible(8, 4, 16, 2) == 1
    assert check_sp_compatible(8, 1, 4, 4) == 4
    assert check_sp_compatible(8, 2, None, 1) == 1


def test_single_process_apply_fsdp_only_checkpoints():
    from transformers.modeling_layers import GradientCheckpointingLayer

    model = apply_fsdp(_model(), ParallelState(), activation_checkpointing=True)
    blocks = block_modules(model)
    assert len(blocks) == 2 and all(
        isinstance(b, GradientCheckpointingLayer) and b.gradient_checkpointing for b in blocks
    )
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    with pytest.raises(ValueError, match=re.escape("declares no _no_split_modules")):
        block_modules(torch.nn.Linear(2, 2))


def test_single_process_clip_matches_torch():
    torch.manual_seed(0)
    grads = [torch.randn(3, 4), torch.randn(7), torch.randn(2, 2, 2)]
    mine = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    theirs = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for m, t, g in zip(mine, theirs, grads, strict=True):
        m.grad, t.grad = g.clone(), g.clone()
    assert torch.equal(clip_grad_norm_(mine, 0.5), torch.nn.utils.clip_grad_norm_(theirs, 0.5))
    assert all(torch.equal(m.grad, t.grad) for m, t in zip(mine, theirs, strict=True))
    assert clip_grad_norm_([torch.nn.Parameter(torch.zeros(2))], 1.0).item() == 0.0  # no grads at all
