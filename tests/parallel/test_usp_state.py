"""The Ulysses x ring (USP) layout: mesh groups at world 4, the head rule on the Ulysses degree only, and the
``parallel.sp / ulysses / ring`` config keys."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from runtime.config.common import ParallelConfig
from runtime.config.errors import ConfigError
from runtime.parallel.collectives import gather_along_dim
from runtime.parallel.state import ParallelState, init_parallel_state
from runtime.sp.heads import check_sp_compatible
from tests.dist_utils import run_distributed


def _ranks(group: object) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def _describe(state: ParallelState) -> dict[str, object]:
    return {
        "sizes": (state.ulysses_size, state.ring_size, state.sp_size),
        "sp": (state.sp_rank, _ranks(state.sp_group)),
        "ulysses": (state.ulysses_rank, _ranks(state.ulysses_group)),
        "ring": (state.ring_rank, _ranks(state.ring_group)),
        "ep": _ranks(state.ep_group),
        "dp": _ranks(state.dp_group),
    }


def _world4_worker(rank: int, world_size: int) -> dict[str, object]:
    out: dict[str, object] = {}
    state = init_parallel_state(sp_size=4, ring_size=2)
    out["u2r2"] = _describe(state)
    # The groups carry traffic.
    out["ring_gather"] = gather_along_dim(torch.tensor([float(rank)]), 0, state.ring_group)
    out["ulysses_gather"] = gather_along_dim(torch.tensor([float(rank)]), 0, state.ulysses_group)
    out["r4"] = _describe(init_parallel_state(sp_size=4, ring_size=4))
    out["shard2_r2"] = _describe(init_parallel_state(sp_size=2, ring_size=2, dp_shard_size=2))
    out["ep2_u2r2"] = _describe(init_parallel_state(sp_size=4, ring_size=2, ep_size=2))
    out["u4"] = _describe(init_parallel_state(sp_size=4))
    hsdp = init_parallel_state(sp_size=2, ring_size=2, dp_replicate_size=2)
    out["hsdp_r2"] = {**_describe(hsdp), "fsdp_shape": tuple(hsdp.fsdp_mesh.shape)}
    try:
        init_parallel_state(sp_size=4, ring_size=3)
        out["error"] = "no error"
    except ValueError as exc:
        out["error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def world4() -> list[dict[str, object]]:
    return run_distributed(_world4_worker, 4)


@pytest.mark.dist
def test_usp_groups_world4(world4):
    u2r2 = [r["u2r2"] for r in world4]
    # ulysses innermost: all-to-all pairs are neighbours; the ring strides over them; sp_rank = ring * 2 + ulysses
    assert [g["ulysses"] for g in u2r2] == [(0, [0, 1]), (1, [0, 1]), (0, [2, 3]), (1, [2, 3])]
    assert [g["ring"] for g in u2r2] == [(0, [0, 2]), (0, [1, 3]), (1, [0, 2]), (1, [1, 3])]
    assert [g["sp"] for g in u2r2] == [(r, [0, 1, 2, 3]) for r in range(4)]
    assert all(g["sizes"] == (2, 2, 4) and g["dp"] == [g_rank] for g_rank, g in enumerate(u2r2))
    assert [r["ring_gather"].tolist() for r in world4] == [[0.0, 2.0], [1.0, 3.0], [0.0, 2.0], [1.0, 3.0]]
    assert [r["ulysses_gather"].tolist() for r in world4] == [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]

    r4 = [r["r4"] for r in world4]
    assert [g["ring"] for g in r4] == [(r, [0, 1, 2, 3]) for r in range(4)]
    assert all(g["ulysses"] == (0, None) and g["sizes"] == (1, 4, 4) for g in r4)

    shard = [r["shard2_r2"] for r in world4]
    assert [g["ring"] for g in shard] == [(0, [0, 1]), (1, [0, 1]), (0, [2, 3]), (1, [2, 3])]
    assert [g["dp"] for g in shard] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(g["ulysses"] == (0, None) for g in shard)

    ep = [r["ep2_u2r2"] for r in world4]
    assert [g["ep"] for g in ep] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # EP still from dp_shard x sp, innermost
    assert [g["ring"] for g in ep] == [g["ring"] for g in u2r2]

    u4 = [r["u4"] for r in world4]  # ring 1: the ulysses group is the SP group, no ring
    assert all(g["ulysses"] == (rank, [0, 1, 2, 3]) and g["ring"] == (0, None) for rank, g in enumerate(u4))
    assert all(r["error"] == "ring_size=3 must divide sp_size=4 (sp = ulysses x ring)" for r in world4)

    hsdp = [r["hsdp_r2"] for r in world4]  # HSDP: parameters replicated over dp_replicate, sharded over the ring
    assert [g["ring"] for g in hsdp] == [(0, [0, 1]), (1, [0, 1]), (0, [2, 3]), (1, [2, 3])]
    assert all(g["fsdp_shape"] == (2, 2) and g["dp"] == [rank % 2, rank % 2 + 2] for rank, g in enumerate(hsdp))


def test_head_rule_checks_ulysses_only():
    # 2 heads: sp 4 cannot be Ulysses alone, but ulysses 2 x ring 2 and ring 4 can.
    with pytest.raises(ValueError, match="sp=4: sp must divide the head count"):
        check_sp_compatible(2, 2, 64, 4)
    assert check_sp_compatible(2, 2, 64, 4, ring_size=2) == 1
    assert check_sp_compatible(2, 1, 64, 4, ring_size=2) == 2  # GQA: the Ulysses degree 2 repeats the one KV head
    assert check_sp_compatible(2, 2, 64, 4, ring_size=4) == 1
    with pytest.raises(ValueError, match=r"sp=4: sp must divide the head count \(with ring=2 the Ulysses degree"):
        check_sp_compatible(2, 2, 64, 8, ring_size=2)
    with pytest.raises(ValueError, match="must be a positive integer dividing sp_size=4"):
        check_sp_compatible(2, 2, 64, 4, ring_size=3)
    with pytest.raises(ValueError, match="ring_size=3 must divide sp_size=4"):
        ParallelState(world_size=4, dp_shard_size=1, sp_size=4, ring_size=3)


@pytest.mark.parametrize(
    "keys, expected",
    [
        ({}, (1, 1, 1)),
        ({"sp": 4}, (4, 4, 1)),
        ({"ring": 2}, (2, 1, 2)),
        ({"ulysses": 2}, (2, 2, 1)),
        ({"sp": 4, "ring": 2}, (4, 2, 2)),
        ({"sp": 4, "ulysses": 1}, (4, 1, 4)),
        ({"ulysses": 2, "ring": 2}, (4, 2, 2)),
        ({"sp": 4, "ulysses": 2, "ring": 2}, (4, 2, 2)),
    ],
)
def test_config_keys(keys, expected):
    p = ParallelConfig(**keys)
    assert (p.sp, p.ulysses, p.ring) == expected


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"sp": 4, "ring": 3}, "parallel.ring: 3 must divide parallel.sp = 4 (sp = ulysses x ring)"),
        ({"sp": 6, "ulysses": 4}, "parallel.ulysses: 4 must divide parallel.sp = 6 (sp = ulysses x ring)"),
        (
            {"sp": 4, "ulysses": 2, "ring": 1},
            "parallel.sp: 4 must equal parallel.ulysses x parallel.ring = 2 x 1 (give two of the three)",
        ),
    ],
)
def test_config_errors(keys, message):
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**keys)
    assert str(info.value) == message
