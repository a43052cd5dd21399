"""Run a function on N local gloo ranks and hand back what each rank returned.

Tests use this instead of torchrun so a whole multi-rank scenario is one ordinary pytest call. The launcher is built to
fail fast and loudly: a rank that raises sends its traceback home, the surviving ranks (probably stuck in a collective
waiting for it) are killed after a short grace period, and the parent raises with every traceback it got.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# After the first rank fails, how long the others get to report before they are killed. Short on purpose: the rest
# are almost always blocked in a collective that can no longer complete.
_FAILURE_GRACE_S = 3.0
_PORT_RETRIES = 3


class DistributedTestError(RuntimeError):
    """One or more ranks failed; the message carries their tracebacks."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    init_group: bool,
    timeout: float,
    results: Any,
) -> None:
    # Everything is caught and reported: the parent distinguishes "raised" (traceback arrives) from "crashed"
    # (process gone, nothing arrived).
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        torch.set_num_threads(1)
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        # Plain pickle bytes, not tensors: torch's queue would pass tensors as shared-memory handles that die with
        # this process, and it exits right after putting.
        payload = pickle.dumps(fn(rank, world_size, *args))
        results.put((rank, True, payload))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def _run_once(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout: float, init_group: bool
) -> tuple[dict[int, Any], dict[int, str]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, args, init_group, timeout, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()

    ok: dict[int, Any] = {}
    failed: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        # Drain the queue *before* joining: a child blocks on exit until its queued result has been read.
        while len(ok) + len(failed) < world_size:
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(world_size)) - ok.keys() - failed.keys())
                for rank in missing:
                    failed[rank] = f"rank {rank}: no result within {timeout:.0f} s (hung or too slow)"
                break
            try:
                rank, success, payload = results.get(timeout=min(0.2, deadline - now))
            except queue_mod.Empty:
                for rank, p in enumerate(procs):
                    if rank in ok or rank in failed or p.is_alive():
                        continue
                    # A process that exited may still have a message in the pipe; give it one more look.
                    try:
                        r, success, payload = results.get(timeout=0.5)
                    except queue_mod.Empty:
                        failed[rank] = f"rank {rank}: process died with exit code {p.exitcode} and sent no result"
                    else:
                        (ok if success else failed)[r] = payload
                continue
            (ok if success else failed)[rank] = payload
            if failed:
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    finally:
        _kill(procs)
        results.close()
    return ok, failed


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120, init_group: bool = True
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return the results in rank order.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function); so must the return values, which should
    be small (CPU tensors, numbers, strings). The env carries RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
    MASTER_PORT like torchrun. With ``init_group=False`` the default process group is left for ``fn`` to create
    (e.g. to test init-from-env code); it is destroyed at the end either way. Ranks are daemonic processes, so
    ``fn`` cannot start processes of its own (e.g. DataLoader workers with ``num_workers > 0``).

    Raises ``DistributedTestError`` with every failing rank's traceback if any rank raises, crashes or hangs.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for attempt in range(_PORT_RETRIES):
        ok, failed = _run_once(fn, world_size, args, timeout, init_group)
        if not failed:
            return [pickle.loads(ok[rank]) for rank in range(world_size)]
        # The free port can be taken between probing and binding it; that (only) is worth a retry.
        port_race = any("EADDRINUSE" in tb or "address already in use" in tb.lower() for tb in failed.values())
        if not port_race or attempt == _PORT_RETRIES - 1:
            break
    report = "\n".join(f"----- rank {rank} -----\n{tb}" for rank, tb in sorted(failed.items()))
    raise DistributedTestError(f"{len(failed)} of {world_size} ranks failed in {fn.__name__}:\n{report}")
