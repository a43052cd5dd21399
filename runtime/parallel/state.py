"""The process layout of a training run, held in one explicit place.

Ranks form a 3-D ``DeviceMesh`` named ``("dp_replicate", "dp_shard", "sp")``, with ``sp`` innermost so that a
sequence-parallel group is made of neighbouring ranks (same node, fastest links). Derived meshes, all built once
(collectively) in ``init_parallel_state``:

* ``dp_mesh`` (1-D, ``"dp"``): ``dp_replicate x dp_shard`` flattened, the ranks that see different data.
* ``fsdp_mesh`` (2-D, ``("dp_replicate", "dp_shard_sp")``): parameters are sharded over ``dp_shard x sp`` (SP ranks
  hold the same parameters, so they shard them too) and replicated over ``dp_replicate`` (HSDP when it is > 1).
* ``loss_mesh`` (1-D, ``"loss"``): every rank that holds different tokens of the global batch,
  ``dp_replicate x dp_shard x sp`` flattened, i.e. the whole world.
* ``usp_mesh`` (4-D, ``("dp_replicate", "dp_shard", "sp_ring", "sp_ulysses")``, only when ``ring_size > 1``): the
  ``sp`` dim unflattened into ``(ring, ulysses)``, ulysses innermost so an all-to-all group is made of neighbouring
  ranks and only the ring's point-to-point traffic crosses further. ``sp_rank = ring_rank * ulysses_size +
  ulysses_rank``, so code that slices a sequence contiguously by ``sp_rank`` (the data layer) still holds. Only the
  Ulysses dim splits heads; the ring dim has no head constraint (it is how SP grows past the head count).
* ``ep_mesh`` (3-D, ``("dp_replicate", "edp_shard", "ep")``, only when ``ep_size > 1``): the ``dp_shard_sp`` dim
  unflattened into ``(dp_shard*sp // ep, ep)``. Experts are sharded over ``ep`` *within one data-parallel replica*,
  and ``ep`` is the innermost (fastest-varying) part of ``dp_shard_sp``: an EP group is ``ep`` consecutive ranks,
  e.g. at world 4 with ``dp_shard=2, sp=2, ep=2`` the EP groups are ``[0, 1]`` and ``[2, 3]`` (= the SP groups),
  so the token all-to-all stays on neighbouring ranks. Expert parameters are then FSDP-sharded/replicated over
  ``expert_fsdp_mesh = ep_mesh["dp_replicate", "edp_shard"]``.

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

from runtime.config.layout import resolve_layout

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "sp")
DP_MESH_DIM_NAME = "dp"
FSDP_MESH_DIM_NAMES = ("dp_replicate", "dp_shard_sp")
LOSS_MESH_DIM_NAME = "loss"
EP_MESH_DIM_NAMES = ("dp_replicate", "edp_shard", "ep")
USP_MESH_DIM_NAMES = ("sp_ring", "sp_ulysses")


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


@dataclass(frozen=True)
class ParallelState:
    """Sizes, this rank's position and the process groups of the current layout.

    ``mesh`` is None only in a single process without torch.distributed; every mesh and group property is then
    None and every rank property 0, which the SP collectives treat as "no communication".
    """

    world_size: int = 1
    rank: int = 0
    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    sp_size: int = 1
    ep_size: int = 1
    ring_size: int = 1  # sp_size = ulysses_size x ring_size
    # issue the Ulysses all-to-alls asynchronously (runtime/sp/overlap.py; bitwise-equal results): a property of the
    # run's layout, so it lives here rather than in a module flag
    overlap: bool = False
    device_type: str = field(default_factory=_default_device_type)
    mesh: DeviceMesh | None = field(default=None, repr=False)
    # The derived meshes are built collectively in init_parallel_state (every rank must take part), so they are
    # stored rather than derived lazily in properties. See the module docstring for their dims.
    dp_mesh: DeviceMesh | None = field(default=None, repr=False)
    fsdp_mesh: DeviceMesh | None = field(default=None, repr=False)
    loss_mesh: DeviceMesh | None = field(default=None, repr=False)
    ep_mesh: DeviceMesh | None = field(default=None, repr=False)
    usp_mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        resolve_layout(
            self.world_size, self.dp_replicate_size, self.dp_shard_size, self.sp_size, self.ep_size, self.ring_size
        )

    # --- sequence parallelism -----------------------------------------------------------------------------------

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

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
        """This rank's place in the whole SP group: ``ring_rank * ulysses_size + ulysses_rank``."""
        return 0 if self.mesh is None else self.mesh.get_local_rank("sp")

    # --- Ulysses x ring (USP) -----------------------------------------------------------------------------------

    @property
    def ulysses_size(self) -> int:
        """The SP degree that splits heads (all-to-all); ``sp_size`` when there is no ring."""
        return self.sp_size // self.ring_size

    @property
    def ring_enabled(self) -> bool:
        return self.ring_size > 1

    @property
    def ulysses_group(self) -> ProcessGroup | None:
        """The all-to-all group (``ulysses_size`` neighbouring ranks), or None when that dim is 1."""
        if self.mesh is None or self.ulysses_size == 1:
            return None
        if self.usp_mesh is None:
            return self.sp_group
        return self.usp_mesh.get_group("sp_ulysses")

    @property
    def ulysses_rank(self) -> int:
        if self.usp_mesh is None:
            return self.sp_rank
        return self.usp_mesh.get_local_rank("sp_ulysses")

    @property
    def ring_group(self) -> ProcessGroup | None:
        """The ring group (ranks ``ulysses_size`` apart in the SP group), or None when there is no ring."""
        return None if self.usp_mesh is None else self.usp_mesh.get_group("sp_ring")

    @property
    def ring_rank(self) -> int:
        return 0 if self.usp_mesh is None else self.usp_mesh.get_local_rank("sp_ring")

    # --- data parallelism ---------------------------------------------------------------------------------------

    @property
    def dp_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def dp_group(self) -> ProcessGroup | None:
        """The flattened data-parallel group; a real (possibly size-1) group whenever there is a mesh."""
        return None if self.dp_mesh is None else self.dp_mesh.get_group()

    @property
    def dp_rank(self) -> int:
        return 0 if self.dp_mesh is None else self.dp_mesh.get_local_rank()

    @property
    def fsdp_shard_size(self) -> int:
        """How many ranks one parameter is sharded over: ``dp_shard x sp``."""
        return self.dp_shard_size * self.sp_size

    @property
    def loss_group(self) -> ProcessGroup | None:
        """All ranks holding different tokens of the global batch (the world); None in a single process."""
        return None if self.loss_mesh is None else self.loss_mesh.get_group()

    # --- expert parallelism -------------------------------------------------------------------------------------

    @property
    def ep_enabled(self) -> bool:
        return self.ep_size > 1

    @property
    def ep_group(self) -> ProcessGroup | None:
        """The EP group (``ep_size`` consecutive ranks of one replica), or None when EP is off."""
        return None if self.ep_mesh is None else self.ep_mesh.get_group("ep")

    @property
    def ep_rank(self) -> int:
        return 0 if self.ep_mesh is None else self.ep_mesh.get_local_rank("ep")

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh expert parameters are FSDP'd over: ``("dp_replicate", "edp_shard")``; ``fsdp_mesh`` without EP."""
        return self.fsdp_mesh if self.ep_mesh is None else self.ep_mesh["dp_replicate", "edp_shard"]


_STATE: ParallelState | None = None


def init_parallel_state(
    sp_size: int = 1,
    dp_replicate_size: int = 1,
    dp_shard_size: int | None = None,
    backend: str | None = None,
    ep_size: int = 1,
    ring_size: int = 1,
    overlap: bool = False,
) -> ParallelState:
    """Set up torch.distributed (from the torchrun env, if not already done), build the meshes, install the handle.

    ``dp_shard_size=None`` takes whatever the world size leaves over. Without torchrun env vars and without an
    initialised process group this is a single process: the sizes must all be 1 and no mesh is built. Calling it
    again builds fresh meshes (new process groups) for the new layout; the old ones stay valid but unused.
    ``ring_size`` (dividing ``sp_size``) splits SP into Ulysses ``sp_size // ring_size`` x ring ``ring_size``;
    ``overlap`` issues the Ulysses all-to-alls asynchronously.
    """
    world_size = dist.get_world_size() if _dist_ready() else int(os.environ.get("WORLD_SIZE", "1"))
    # Validate before any collective call so that a bad layout fails identically on every rank instead of hanging.
    dp_shard_size = resolve_layout(world_size, dp_replicate_size, dp_shard_size, sp_size, ep_size, ring_size)

    if not _dist_ready() and "WORLD_SIZE" in os.environ:
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "nccl" in backend:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)

    if not _dist_ready():
        state = ParallelState(overlap=overlap)
    else:
        device_type = "cuda" if torch.cuda.is_available() and "nccl" in str(dist.get_backend()) else "cpu"
        mesh = init_device_mesh(
            device_type, (dp_replicate_size, dp_shard_size, sp_size), mesh_dim_names=MESH_DIM_NAMES
        )
        dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten(DP_MESH_DIM_NAME)
        loss_mesh = mesh._flatten(LOSS_MESH_DIM_NAME)
        # Unflattening the world (rather than slicing a flattened dim off the root mesh, which torch deprecates)
        # keeps dp_replicate outermost and dp_shard x sp as one contiguous inner dim.
        fsdp_mesh = loss_mesh._unflatten(0, (dp_replicate_size, dp_shard_size * sp_size), FSDP_MESH_DIM_NAMES)
        ep_mesh = None
        if ep_size > 1:
            ep_mesh = fsdp_mesh._unflatten(
                "dp_shard_sp", (dp_shard_size * sp_size // ep_size, ep_size), EP_MESH_DIM_NAMES[1:]
            )
        usp_mesh = None
        if ring_size > 1:
            usp_mesh = mesh._unflatten("sp", (ring_size, sp_size // ring_size), USP_MESH_DIM_NAMES)
        state = ParallelState(
            world_size=world_size,
            rank=dist.get_rank(),
            dp_replicate_size=dp_replicate_size,
            dp_shard_size=dp_shard_size,
            sp_size=sp_size,
            ep_size=ep_size,
            ring_size=ring_size,
            overlap=overlap,
            device_type=device_type,
            mesh=mesh,
            dp_mesh=dp_mesh,
            fsdp_mesh=fsdp_mesh,
            loss_mesh=loss_mesh,
            ep_mesh=ep_mesh,
            usp_mesh=usp_mesh,
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
