"""The process layout of a training run, held in one explicit place.

Ranks form a 3-D ``DeviceMesh`` named ``("dp_replicate", "dp_shard", "sp")``, with ``sp`` innermost so that a
sequence-parallel group is made of neighbouring ranks (same node, fastest links). The data-parallel group is
``dp_replicate x dp_shard`` flattened: the ranks that see different data and average gradients.

The state is immutable and lives in a single module-level handle, set by ``init_parallel_state`` (or
``set_parallel_state`` / ``parallel_state`` in tests). Code that needs the layout calls ``get_parallel_state()``;
before any init that returns a single-process state, so model code runs unchanged without torch.distributed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "sp")
DP_MESH_DIM_NAME = "dp"


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _resolve_layout(world_size: int, dp_replicate_size: int, dp_shard_size: int | None, sp_size: int) -> int:
    """Check that the sizes tile the world exactly and return dp_shard_size (derived when None)."""
    shard = "auto" if dp_shard_size is None else dp_shard_size
    sizes = f"dp_replicate_size={dp_replicate_size}, dp_shard_size={shard}, sp_size={sp_size}, world size {world_size}"
    given = [s for s in (dp_replicate_size, dp_shard_size, sp_size) if s is not None]
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in given):
        raise ValueError(f"parallel sizes must be positive integers: {sizes}")
    if dp_shard_size is None:
        if world_size % (dp_replicate_size * sp_size):
            raise ValueError(f"world size is not a multiple of dp_replicate_size x sp_size: {sizes}")
        dp_shard_size = world_size // (dp_replicate_size * sp_size)
    if dp_replicate_size * dp_shard_size * sp_size != world_size:
        raise ValueError(f"dp_replicate_size x dp_shard_size x sp_size must equal the world size: {sizes}")
    return dp_shard_size


@dataclass(frozen=True)
class ParallelState:
    """Sizes, this rank's position and the process groups of the current layout.

    ``mesh`` is None only in a single process without torch.distributed; every group property is then None and
    every rank property 0, which the SP collectives treat as "no communication".
    """

    world_size: int = 1
    rank: int = 0
    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    sp_size: int = 1
    device_type: str = field(default_factory=_default_device_type)
    mesh: DeviceMesh | None = field(default=None, repr=False)
    # The flattened dp_replicate x dp_shard mesh. Built collectively in init_parallel_state (every rank must take
    # part), so it is stored rather than derived lazily in a property.
    dp_mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _resolve_layout(self.world_size, self.dp_replicate_size, self.dp_shard_size, self.sp_size)

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

    @property
    def dp_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def sp_mesh(self) -> DeviceMesh | None:
        return None if self.mesh is None else self.mesh["sp"]

    @property
    def sp_group(self) -> ProcessGroup | None:
        """The SP group, or None when SP is off (so the collectives are free).

        Never hand None to a raw ``torch.distributed`` call: there it means the *world* group.
        """
        if self.mesh is None or not self.sp_enabled:
            return None
        return self.mesh.get_group("sp")

    @property
    def sp_rank(self) -> int:
        return 0 if self.mesh is None else self.mesh.get_local_rank("sp")

    @property
    def dp_group(self) -> ProcessGroup | None:
        """The flattened data-parallel group; a real (possibly size-1) group whenever there is a mesh."""
        return None if self.dp_mesh is None else self.dp_mesh.get_group()

    @property
    def dp_rank(self) -> int:
        return 0 if self.dp_mesh is None else self.dp_mesh.get_local_rank()


_STATE: ParallelState | None = None


def init_parallel_state(
    sp_size: int = 1,
    dp_replicate_size: int = 1,
    dp_shard_size: int | None = None,
    backend: str | None = None,
) -> ParallelState:
    """Set up torch.distributed (from the torchrun env, if not already done), build the mesh, install the handle.

    ``dp_shard_size=None`` takes whatever the world size leaves over. Without torchrun env vars and without an
    initialised process group this is a single process: the sizes must all be 1 and no mesh is built.
    """
    world_size = dist.get_world_size() if _dist_ready() else int(os.environ.get("WORLD_SIZE", "1"))
    # Validate before any collective call so that a bad layout fails identically on every rank instead of hanging.
    dp_shard_size = _resolve_layout(world_size, dp_replicate_size, dp_shard_size, sp_size)

    if not _dist_ready() and "WORLD_SIZE" in os.environ:
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "nccl" in backend:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)

    if not _dist_ready():
        state = ParallelState()
    else:
        device_type = "cuda" if torch.cuda.is_available() and "nccl" in str(dist.get_backend()) else "cpu"
        mesh = init_device_mesh(
            device_type, (dp_replicate_size, dp_shard_size, sp_size), mesh_dim_names=MESH_DIM_NAMES
        )
        dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten(DP_MESH_DIM_NAME)
        state = ParallelState(
            world_size=world_size,
            rank=dist.get_rank(),
            dp_replicate_size=dp_replicate_size,
            dp_shard_size=dp_shard_size,
            sp_size=sp_size,
            device_type=device_type,
            mesh=mesh,
            dp_mesh=dp_mesh,
        )
    set_parallel_state(state)
    return state


def get_parallel_state() -> ParallelState:
    """The current layout; a single-process state before any init."""
    return _STATE if _STATE is not None else ParallelState()


def set_parallel_state(state: ParallelState | None) -> None:
    """Replace the handle; None resets to the single-process default."""
    global _STATE
    _STATE = state


@contextmanager
def parallel_state(state: ParallelState | None) -> Iterator[ParallelState]:
    """Install ``state`` for the duration of a block, then restore whatever was there."""
    previous = _STATE
    set_parallel_state(state)
    try:
        yield get_parallel_state()
    finally:
        set_parallel_state(previous)
