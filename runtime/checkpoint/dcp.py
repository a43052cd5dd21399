"""Sharded, atomic, exactly-resumable training checkpoints on torch.distributed.checkpoint (DCP).

A checkpoint holds everything a training step depends on: the model and optimizer (through DCP, each rank writing
the shards it owns, so FSDP2 and plain modules alike and the world size may change between save and load), and per
rank the LR scheduler, the RNG states (torch CPU and CUDA generators, python ``random``, numpy when installed) and a
small ``extra`` dict for the caller (data-loader position, step, metrics).

Layout under ``root``::

    step_000015/               a complete checkpoint; only ever comes into being by a rename
        .metadata, *.distcp    DCP: model + optimizer
        rank_00000.pt, ...     per rank: scheduler, RNG states, extra
        COMPLETE               json, written last, before the rename
    .step_000020.tmp/          a save in progress, or one that was killed: never read, removed by the next save

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
import pickle
import random
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
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_STALE_DIR = re.compile(r"^\.step_\d+\.(tmp|old)$")
_FORMAT_VERSION = 1


def checkpoint_dir_name(step: int) -> str:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return f"step_{step:06d}"


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


# ------------------------------------------------------------------------------------------------------------- RNG


def get_rng_state() -> dict[str, Any]:
    """Every generator a training step may draw from, on this process."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) != torch.cuda.device_count():
            logger.warning(
                "checkpoint holds CUDA RNG states of %d devices, this process sees %d; restoring the first ones only",
                len(cuda_states),
                torch.cuda.device_count(),
            )
        for device, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


# ------------------------------------------------------------------------------------------------------ discovery


def is_complete_checkpoint(path: Path) -> bool:
    path = Path(path)
    return _STEP_DIR.match(path.name) is not None and (path / COMPLETE_MARKER).is_file()


def list_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete_checkpoint(p)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root``; None if there is none."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def checkpoint_step(path: Path) -> int:
    match = _STEP_DIR.match(Path(path).name)
    if match is None:
        raise ValueError(f"not a checkpoint directory name (step_<n>): {path}")
    return int(match.group(1))


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


# ------------------------------------------------------------------------------------------------------ save/load


def _rank_file(path: Path, rank: int) -> Path:
    return path / f"rank_{rank:05d}.pt"


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
    keep: int | None = None,
    process_group: ProcessGroup | None = None,
) -> Path:
    """Save a complete checkpoint as ``root/step_<step>`` and return its path. Collective: every rank calls it.

    ``extra`` is kept per rank and handed back by ``load_checkpoint`` on the same rank; it must be picklable and
    small. ``keep`` then removes complete checkpoints until ``keep`` are left: this one and the highest other steps.
    ``process_group`` is the group of all ranks that hold parts of the model (default: the world).

    An optimizer that has not stepped yet gets its state created here (DCP's lr=0 step on zero gradients: the
    parameters do not move, but AdamW's step count becomes 1), so a save before the first step changes the run's
    later updates; resuming from it still continues exactly like the run that saved.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    extra = dict(extra or {})
    try:  # fail before any file or collective, not after the shards are written
        pickle.dumps(extra)
    except Exception as e:
        raise TypeError(f"extra must be picklable: {e}") from e
    rng = get_rng_state()  # before anything else could draw; restored at the end, so saving is RNG-neutral
    root = Path(root)
    name = checkpoint_dir_name(step)
    final, tmp = root / name, root / f".{name}.tmp"
    rank, world_size = _rank(process_group), _world_size(process_group)

    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale(root)
        tmp.mkdir()
    _barrier(process_group)  # nobody writes into tmp before it is clean

    with _single_process_is_intended():
        dcp.save(
            _dcp_state(model, optimizer),
            storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
            process_group=process_group,
            no_dist=not _dist_ready(),
        )
    _fault_point("dcp_saved", tmp)
    per_rank = {
        "format_version": _FORMAT_VERSION,
        "rank": rank,
        "world_size": world_size,
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "rng": rng,
        "extra": extra,
    }
    rank_file = _rank_file(tmp, rank)
    torch.save(per_rank, rank_file)
    _fsync_path(rank_file)
    _barrier(process_group)  # every rank's files are on disk

    if rank == 0:
        marker = {"step": step, "world_size": world_size, "format_version": _FORMAT_VERSION, "time": time.time()}
        _write_durably(tmp / COMPLETE_MARKER, json.dumps(marker).encode())
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
    restore_rng: bool = True,
    process_group: ProcessGroup | None = None,
) -> dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint`` in place; return this rank's ``extra``. Collective.

    The model (plain or FSDP2) and optimizer must be built the same way as when saving (same parameters and param
    groups); the world size may differ, in which case model and optimizer are resharded by DCP but the per-rank
    RNG states cannot be matched to ranks and are not restored (the resumed run is then not exact), and every rank
    gets rank 0's ``extra``. RNG states are restored last, so nothing after the load disturbs them.
    """
    path = Path(path)
    if not is_complete_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker in a step_<n> dir)")
    rank, world_size = _rank(process_group), _world_size(process_group)

    # For a fresh optimizer get_state_dict creates the state (an lr=0 step on zero gradients) that DCP loads into.
    state = _dcp_state(model, optimizer)
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=path, process_group=process_group, no_dist=not _dist_ready())
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    own = _rank_file(path, rank)
    same_layout = own.is_file() and json.loads((path / COMPLETE_MARKER).read_text())["world_size"] == world_size
    # weights_only=False: the file holds python RNG state and a caller's dict; checkpoints are trusted input, as
    # they are for DCP itself, which unpickles its metadata.
    per_rank = torch.load(own if same_layout else _rank_file(path, 0), weights_only=False)
    if not same_layout:
        logger.warning(
            "%s was saved by %d ranks, loading on %d: model and optimizer are resharded, RNG states are "
            "not restored and every rank gets rank 0's extra",
            path,
            per_rank["world_size"],
            world_size,
        )
    if scheduler is not None:
        if per_rank["scheduler"] is None:
            raise ValueError(f"{path} holds no scheduler state")
        scheduler.load_state_dict(per_rank["scheduler"])
    if restore_rng and same_layout:
        set_rng_state(per_rank["rng"])
    return per_rank["extra"]
