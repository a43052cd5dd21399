"""``full_tensors`` gathers many sharded DTensors with one collective per sharding and gives exactly what each one's
``full_tensor()`` gives: rows that split unevenly over the ranks (5 over 2), a tensor with fewer rows than ranks
(one rank holds none), a vector, a 2-D mesh with a replicated dimension (HSDP's), and a replicated tensor."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

SHAPES = {"uneven": (5, 3), "one row": (1, 4), "vector": (7,), "even": (4, 2, 2)}


def gather_worker(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from runtime.parallel.full_tensors import full_tensors

    flat = init_device_mesh("cpu", (world_size,))
    hsdp = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in SHAPES.items():
        full = torch.randn(shape, generator=generator)
        tensors[name] = distribute_tensor(full, flat, [Shard(0)])
        tensors[f"{name} hsdp"] = distribute_tensor(full, hsdp, [Replicate(), Shard(0)])
    tensors["replicated"] = distribute_tensor(torch.randn(3, generator=generator), flat, [Replicate()])
    got = full_tensors(tensors)
    assert list(got) == list(tensors)
    return [name for name, tensor in tensors.items() if not torch.equal(got[name], tensor.full_tensor())]


@pytest.mark.dist
def test_full_tensors_equal_each_full_tensor() -> None:
    assert run_distributed(gather_worker, 2) == [[], []]
