"""Sharded, atomic, exactly-resumable training checkpoints on torch.distributed.checkpoint (DCP).

A checkpoint holds everything a training step depends on: the model and optimizer (through DCP, each rank writing
the shards it owns, so FSDP2 and plain modules alike and the world size may change between save and load), and per
rank the LR scheduler, the RNG states (torch CPU and CUDA generators, python ``random``, numpy when installed) and a
small ``extra`` dict of JSON data for the caller (data-loader position, step, metrics).

Layout under ``root``::

    step_000015/               a complete checkpoint; only ever comes into being by a rename
        .metadata, *.distcp    DCP: model + optimizer
        rank_00000.safetensors per rank: the RNG states' tensors
        rank_00000.json        per rank: scheduler state, the rest of the RNG states, extra
        COMPLETE               json, written last, before the rename: step, world size, the model's type and config
                               (``runtime/checkpoint/identity.py``), and every other file's size and sha256
                               (``runtime/checkpoint/verify.py``)
    .step_000020.tmp/          a save in progress, or one that was killed: never read, removed by the next save

Nothing of ours is pickled: the per-rank state is safetensors + JSON. ``load_checkpoint`` verifies every file
against the marker before it reads any (``verify=False`` skips that when the caller has just verified).

A save writes into the ``.tmp`` directory; once every rank has finished (barrier), rank 0 writes ``COMPLETE``,
fsyncs, renames the directory into place and fsyncs ``root``. A process killed at any point of a save therefore
leaves at most a ``.tmp`` directory next to the previous, intact checkpoints, and ``latest_checkpoint`` only returns
directories named ``step_<n>`` that carry ``COMPLETE``. Every rank must see the same ``root`` (a shared file system
across nodes), as DCP's file system writer requires anyway.

Saving is RNG-neutral (it restores the generators it found), so a run that saves continues exactly as one that does
not; loading restores this rank's RNG states last. Together with the optimizer state (AdamW step counts included)
and the scheduler's ``last_epoch``, a run that resumes from step k continues bitwise identically to the run that
never stopped, provided it rebuilds the same model, optimizer and scheduler and feeds the same data from step k.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from runtime.checkpoint.dcp_io import SafeFileSystemReader, SafeLoadPlanner
from runtime.checkpoint.discovery import (
    COMPLETE_MARKER,
    checkpoint_dir_name,
    checkpoint_step,
    is_complete_checkpoint,
    latest_checkpoint,
    list_checkpoints,
)
from runtime.checkpoint.identity import mismatch_message, module_identity
from runtime.checkpoint.rank_state import (
    encode_rank_state,
    get_rng_state,
    json_data,
    rank_files,
    read_rank_state,
    restore_rng_state,
    rng_from_files,
    rng_to_files,
    set_rng_state,
)
from runtime.checkpoint.verify import (
    FORMAT_VERSION,
    CheckpointError,
    HashingFileSystemWriter,
    complete_digests,
    digest_bytes,
    gather_digests,
    read_marker,
    verify_checkpoint,
)

logger = logging.getLogger(__name__)

__all__ = [  # the discovery and RNG helpers are re-exported: callers import them from here
    "checkpoint_dir_name",
    "checkpoint_step",
    "get_rng_state",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "latest_intact_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "replace_dir_atomically",
    "rng_from_files",
    "rng_to_files",
    "save_checkpoint",
    "set_rng_state",
]

_STALE_DIR = re.compile(r"^\.step_\d+\.(tmp|old)$")


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank(group: ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if _dist_ready() else 0


def _world_size(group: ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if _dist_ready() else 1


def _barrier(group: ProcessGroup | None = None) -> None:
    if _dist_ready():
        dist.barrier(group=group)


@contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Without a process group DCP warns on every call that it assumes a single process; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _fault_point(stage: str, path: Path) -> None:
    """Does nothing. Tests replace it to stop a save at ``stage`` (e.g. to SIGKILL the process there)."""


# ----------------------------------------------------------------------------------------------------------- fsync


def _fsync_path(path: Path) -> None:
    """fsync a file or a directory (the latter makes renames and new entries in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_dir_atomically(tmp: Path, final: Path) -> None:
    """Move the finished directory ``tmp`` to ``final``, replacing any previous ``final``, and make it durable.

    A directory cannot be renamed over a non-empty one, so an existing ``final`` is first moved aside to
    ``.<name>.old`` (removed afterwards, or by the next save if we die in between).
    """
    _fsync_tree(tmp)
    old = final.with_name(f".{final.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_path(final.parent)
    if old.exists():
        shutil.rmtree(old)


# ------------------------------------------------------------------------------------------------------ discovery


def _remove_stale(root: Path) -> None:
    for p in root.iterdir():
        if _STALE_DIR.match(p.name):
            logger.info("removing the leftovers of an interrupted save: %s", p)
            shutil.rmtree(p, ignore_errors=True)


def _prune(root: Path, keep: int, current: Path) -> None:
    """Keep ``current`` and the ``keep - 1`` highest other steps, whatever ``current``'s step is."""
    others = [p for p in list_checkpoints(root) if p != current]
    for p in others[: max(0, len(others) - (keep - 1))]:
        # Rename first so a crash halfway through the rmtree cannot leave a complete-looking, partial checkpoint.
        doomed = p.with_name(f".{p.name}.old")
        os.rename(p, doomed)
        shutil.rmtree(doomed)


def latest_intact_checkpoint(
    root: Path, *, process_group: ProcessGroup | None = None
) -> tuple[Path | None, list[CheckpointError]]:
    """The newest checkpoint under ``root`` that verifies, and the errors of the newer ones that did not (newest
    first); ``(None, errors)`` when none does. Collective when distributed. The caller says what it skipped: a
    warning logged here too would reach the console through logging's last-resort handler, printing each message
    twice (once more in the caller's error when none is intact)."""
    skipped: list[CheckpointError] = []
    for path in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(path, process_group=process_group)
        except CheckpointError as exc:
            logger.debug("skipping %s", exc)
            skipped.append(exc)
            continue
        return path, skipped
    return None, skipped


# ------------------------------------------------------------------------------------------------------ save/load


def _dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    extra: dict[str, Any] | None = None,
    *,
    identity: dict[str, Any] | None = None,
    keep: int | None = None,
    process_group: ProcessGroup | None = None,
) -> Path:
    """Save a complete checkpoint as ``root/step_<step>`` and return its path. Collective: every rank calls it.

    ``extra`` is kept per rank and handed back by ``load_checkpoint`` on the same rank; it must be small JSON data
    (it is stored as JSON, never pickled). ``keep`` then removes complete checkpoints until ``keep`` are left: this
    one and the highest other steps. ``process_group`` is the group of all ranks that hold parts of the model
    (default: the world). The completion marker lists every file with its size and sha256, taken while writing,
    and the model's ``identity`` (``runtime/checkpoint/identity.py``; default: the model's own config and type),
    which ``load_checkpoint`` compares before it reads a weight.

    An optimizer that has not stepped yet gets its state created here (DCP's lr=0 step on zero gradients: the
    parameters do not move, but AdamW's step count becomes 1), so a save before the first step changes the run's
    later updates; resuming from it still continues exactly like the run that saved.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    extra = dict(extra or {})
    rng = get_rng_state()  # before anything else could draw; restored at the end, so saving is RNG-neutral
    rank, world_size = _rank(process_group), _world_size(process_group)
    # Encoded before any file or collective, so that state which cannot be stored fails here, not after the shards.
    json_data(extra, "extra")
    identity = json.loads(json_data(identity or module_identity(model), "the model identity"))
    rank_tensors, rank_json = encode_rank_state(rank, world_size, scheduler, rng, extra)
    root = Path(root)
    name = checkpoint_dir_name(step)
    final, tmp = root / name, root / f".{name}.tmp"

    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale(root)
        tmp.mkdir()
    _barrier(process_group)  # nobody writes into tmp before it is clean

    writer = HashingFileSystemWriter(tmp, sync_files=True)
    with _single_process_is_intended():
        dcp.save(
            _dcp_state(model, optimizer),
            storage_writer=writer,
            process_group=process_group,
            no_dist=not _dist_ready(),
        )
    _fault_point("dcp_saved", tmp)
    digests = writer.digests
    for file, data in zip(rank_files(tmp, rank), (rank_tensors, rank_json), strict=True):
        _write_durably(file, data)
        digests[file.name] = digest_bytes(data)
    digests = gather_digests(digests, process_group)
    _barrier(process_group)  # every rank's files are on disk

    if rank == 0:
        marker = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": world_size,
            "model": identity,
            "time": time.time(),
            "files": complete_digests(tmp, digests),
        }
        _write_durably(tmp / COMPLETE_MARKER, (json.dumps(marker, indent=1, sort_keys=True) + "\n").encode())
        _fault_point("before_rename", tmp)
        replace_dir_atomically(tmp, final)
        if keep is not None:
            _prune(root, keep, final)
    _barrier(process_group)  # nobody goes on (or looks for the latest checkpoint) before it is in place
    set_rng_state(rng)
    return final


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    *,
    identity: dict[str, Any] | None = None,
    restore_rng: bool = True,
    verify: bool = True,
    process_group: ProcessGroup | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint`` in place; return this rank's ``extra``. Collective.

    Every file is first checked against the completion marker (``verify_checkpoint``; ``verify=False`` when the
    caller has just done that): a damaged checkpoint raises ``CheckpointError`` before anything is read from it.
    Then, before any weight is read: the model ``identity`` the checkpoint records must equal ``identity`` (when
    given: the trainer passes its run's), and this rank's state must have the structure ``save_checkpoint`` writes
    (``runtime/checkpoint/rank_state.py``); either is a ``CheckpointError`` naming the checkpoint and the key.
    The model (plain or FSDP2) and optimizer must be built the same way as when saving (same parameters and param
    groups); the world size may differ, in which case model and optimizer are resharded by DCP but the per-rank
    RNG states cannot be matched to ranks and are not restored (the resumed run is then not exact), and every rank
    gets rank 0's ``extra``. RNG states are restored last, so nothing after the load disturbs them.
    """
    path = Path(path)
    marker = verify_checkpoint(path, process_group=process_group) if verify else read_marker(path)
    rank, world_size = _rank(process_group), _world_size(process_group)
    if identity is not None:
        mismatch = mismatch_message(path, marker["model"], json.loads(json_data(identity, "the model identity")))
        if mismatch:
            raise CheckpointError(mismatch)
    same_layout = marker["world_size"] == world_size
    source_rank = rank if same_layout else 0
    tensors, per_rank = read_rank_state(path, source_rank, marker["world_size"], scheduler)
    if not same_layout:
        logger.warning(
            "%s was saved by %d ranks, loading on %d: model and optimizer are resharded, RNG states are "
            "not restored and every rank gets rank 0's extra",
            path,
            marker["world_size"],
            world_size,
        )

    # For a fresh optimizer get_state_dict creates the state (an lr=0 step on zero gradients) that DCP loads into.
    state = _dcp_state(model, optimizer)
    with _single_process_is_intended():
        reader = SafeFileSystemReader(path)
        reader.check_metadata()  # before dcp.load, which logs a failed read's traceback before it fails
        try:
            dcp.load(
                state,
                storage_reader=reader,
                planner=SafeLoadPlanner(),
                process_group=process_group,
                no_dist=not _dist_ready(),
            )
        except CheckpointException as exc:  # a BaseException carrying every rank's traceback: one line instead
            if reader.refused is not None:  # verified, yet not DCP metadata: written by something else
                raise CheckpointError(f"checkpoint {path}: refusing its .metadata: {reader.refused}") from None
            first = next(iter(exc.failures.values()))[0]
            why = " ".join(str(first).split())[:300]
            raise CheckpointError(
                f"checkpoint {path} does not fit this model and optimizer ({type(first).__name__}: {why})"
            ) from None
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if scheduler is not None:
        scheduler.load_state_dict(per_rank["scheduler"])
    if restore_rng and same_layout:
        restore_rng_state(path, tensors, per_rank["rng"])
    return per_rank["extra"]
