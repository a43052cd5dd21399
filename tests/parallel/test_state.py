"""ParallelState: the single-process default, layout validation and the mesh groups at world sizes 2 and 4."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist

from runtime.parallel.collectives import gather_along_dim
from runtime.parallel.state import (
    ParallelState,
    get_parallel_state,
    init_parallel_state,
    parallel_state,
    set_parallel_state,
)
from tests.dist_utils import run_distributed


@pytest.fixture(autouse=True)
def _reset_state():
    set_parallel_state(None)
    yield
    set_parallel_state(None)


# --- single process ---------------------------------------------------------------------------------------------


def _assert_single_process(state: ParallelState) -> None:
    assert (state.world_size, state.rank) == (1, 0)
    assert (state.dp_replicate_size, state.dp_shard_size, state.sp_size, state.dp_size) == (1, 1, 1, 1)
    assert state.mesh is None and state.dp_mesh is None and state.sp_mesh is None
    assert not state.sp_enabled
    assert state.sp_group is None and state.dp_group is None
    assert state.sp_rank == 0 and state.dp_rank == 0


def test_default_before_init_is_single_process():
    _assert_single_process(get_parallel_state())


def test_init_without_torchrun_env_is_single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    state = init_parallel_state()
    _assert_single_process(state)
    assert get_parallel_state() is state
    assert not dist.is_initialized()


def test_init_without_torchrun_env_rejects_sp(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"world size 1"):
        init_parallel_state(sp_size=2)
    _assert_single_process(get_parallel_state())  # nothing was installed


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"world_size": 4, "sp_size": 3, "dp_shard_size": 1}, r"must equal the world size: .*sp_size=3, world size 4"),
        ({"world_size": 2, "sp_size": 0, "dp_shard_size": 2}, r"positive integers: .*sp_size=0"),
        ({"world_size": 2, "dp_replicate_size": -1, "dp_shard_size": -2}, r"positive integers"),
        ({"world_size": 2, "sp_size": 2.0, "dp_shard_size": 1}, r"positive integers"),
    ],
)
def test_state_validates_layout(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ParallelState(**kwargs)


def test_state_is_frozen():
    state = ParallelState()
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.sp_size = 2


def test_set_and_context_manager_restore():
    outer = ParallelState(device_type="cpu")
    inner = ParallelState(device_type="meta")
    set_parallel_state(outer)
    with parallel_state(inner) as current:
        assert current is inner and get_parallel_state() is inner
    assert get_parallel_state() is outer
    with pytest.raises(RuntimeError), parallel_state(inner):
        raise RuntimeError("boom")
    assert get_parallel_state() is outer
    set_parallel_state(None)
    _assert_single_process(get_parallel_state())


# --- distributed ------------------------------------------------------------------------------------------------


def _describe(state: ParallelState) -> dict[str, object]:
    return {
        "world_size": state.world_size,
        "rank": state.rank,
        "sizes": (state.dp_replicate_size, state.dp_shard_size, state.sp_size),
        "sp_enabled": state.sp_enabled,
        "sp_rank": state.sp_rank,
        "sp_ranks": None if state.sp_group is None else dist.get_process_group_ranks(state.sp_group),
        "dp_size": state.dp_size,
        "dp_rank": state.dp_rank,
        "dp_ranks": dist.get_process_group_ranks(state.dp_group),
        "mesh_shape": tuple(state.mesh.shape),
        "device_type": state.device_type,
        "installed": get_parallel_state() is state,
    }


def _invalid(**kwargs: int) -> str:
    try:
        init_parallel_state(**kwargs)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _world2_worker(rank: int, world_size: int) -> dict[str, object]:
    assert not dist.is_initialized()  # launched with init_group=False: init_parallel_state reads the torchrun env
    out: dict[str, object] = {"sp2": _describe(init_parallel_state(sp_size=2))}
    out["backend"] = dist.get_backend()
    out["shard2"] = _describe(init_parallel_state(dp_shard_size=2))
    out["auto"] = _describe(init_parallel_state())
    out["replicate2"] = _describe(init_parallel_state(dp_replicate_size=2))
    before = get_parallel_state()
    out["errors"] = {
        "sp3": _invalid(sp_size=3),
        "too_many": _invalid(dp_replicate_size=2, dp_shard_size=2),
        "zero": _invalid(sp_size=0),
        "shard0": _invalid(dp_shard_size=0),
    }
    out["kept_after_errors"] = get_parallel_state() is before
    return out


def _world4_worker(rank: int, world_size: int) -> dict[str, object]:
    state = init_parallel_state(sp_size=2, dp_shard_size=2)
    out: dict[str, object] = {"shard2_sp2": _describe(state)}
    # The groups carry traffic: gather over SP, sum over DP.
    out["sp_gather"] = gather_along_dim(torch.tensor([float(rank)]), 0, state.sp_group)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=state.dp_group)
    out["dp_sum"] = total
    out["replicate2_sp2"] = _describe(init_parallel_state(sp_size=2, dp_replicate_size=2))
    out["replicate2_shard2"] = _describe(init_parallel_state(dp_replicate_size=2, dp_shard_size=2))
    return out


@pytest.fixture(scope="module")
def world2() -> list[dict[str, object]]:
    return run_distributed(_world2_worker, 2, init_group=False)


@pytest.fixture(scope="module")
def world4() -> list[dict[str, object]]:
    return run_distributed(_world4_worker, 4)


@pytest.mark.dist
def test_world2_initialises_gloo_from_env(world2):
    assert [r["backend"] for r in world2] == ["gloo", "gloo"]


@pytest.mark.dist
@pytest.mark.parametrize(
    "layout, sizes, sp_ranks, dp_ranks",
    [
        ("sp2", (1, 1, 2), [[0, 1], [0, 1]], [[0], [1]]),
        ("shard2", (1, 2, 1), [None, None], [[0, 1], [0, 1]]),
        ("auto", (1, 2, 1), [None, None], [[0, 1], [0, 1]]),
        ("replicate2", (2, 1, 1), [None, None], [[0, 1], [0, 1]]),
    ],
)
def test_world2_layouts(world2, layout, sizes, sp_ranks, dp_ranks):
    got = [r[layout] for r in world2]
    sp = sizes[2]
    for rank, g in enumerate(got):
        assert (g["world_size"], g["rank"], g["sizes"], g["mesh_shape"]) == (2, rank, sizes, sizes)
        assert g["sp_enabled"] is (sp > 1)
        assert g["sp_rank"] == (rank if sp > 1 else 0)
        assert g["dp_size"] == 2 // sp and g["dp_rank"] == (0 if sp > 1 else rank)
        assert g["device_type"] == "cpu" and g["installed"]
    assert [g["sp_ranks"] for g in got] == sp_ranks
    assert [g["dp_ranks"] for g in got] == dp_ranks


@pytest.mark.dist
@pytest.mark.parametrize(
    "key, pattern",
    [
        ("sp3", r"world size is not a multiple of dp_replicate_size x sp_size: .*sp_size=3, world size 2"),
        ("too_many", r"must equal the world size: dp_replicate_size=2, dp_shard_size=2, sp_size=1, world size 2"),
        ("zero", r"positive integers: .*sp_size=0, world size 2"),
        ("shard0", r"positive integers: .*dp_shard_size=0"),
    ],
)
def test_world2_invalid_layouts(world2, key, pattern):
    for r in world2:
        message = r["errors"][key]
        assert "\n" not in message and re.search(pattern, message), message
        assert r["kept_after_errors"]


@pytest.mark.dist
def test_world4_shard2_sp2_groups(world4):
    got = [r["shard2_sp2"] for r in world4]
    # sp is the innermost mesh dim: SP pairs are neighbouring ranks, DP pairs stride over them.
    assert [g["sp_ranks"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["dp_ranks"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["sp_rank"] for g in got] == [0, 1, 0, 1]
    assert [g["dp_rank"] for g in got] == [0, 0, 1, 1]
    assert all(g["sizes"] == (1, 2, 2) and g["dp_size"] == 2 and g["sp_enabled"] for g in got)
    assert [r["sp_gather"].tolist() for r in world4] == [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]
    assert [r["dp_sum"].item() for r in world4] == [2.0, 4.0, 2.0, 4.0]


@pytest.mark.dist
def test_world4_dp_flattens_replicate_and_shard(world4):
    rep_sp = [r["replicate2_sp2"] for r in world4]
    assert [g["dp_ranks"] for g in rep_sp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["sp_ranks"] for g in rep_sp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    rep_shard = [r["replicate2_shard2"] for r in world4]
    assert all(g["dp_ranks"] == [0, 1, 2, 3] and g["sp_ranks"] is None for g in rep_shard)
    assert [g["dp_rank"] for g in rep_shard] == [0, 1, 2, 3]
