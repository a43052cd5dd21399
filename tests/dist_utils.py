"""Run a function on N local gloo ranks and hand back what each rank returned.

Tests use this instead of torchrun so a whole multi-rank scenario is one ordinary pytest call. Rank processes are
**shared across tests**: one pool of N spawned workers per world size lives for the pytest session, so each call
pays for a process group (milliseconds), not for N interpreters importing torch and transformers (seconds each on
two cores). Between calls a worker destroys the process group, resets the parallel-state handle and restores its
environment, working directory and torch's default dtype, so a call sees what a fresh rank would.

After each call a worker also *frees* that call's process groups (``release_process_groups(collect=True)``): a
destroyed gloo group keeps its transport thread (``gloo_tcp_loop``) until the object is collected, and the meshes
that hold it form reference cycles that Python's collector, on a heap the size of torch + transformers, rarely gets
to. Left to it, a session's ranks accumulated hundreds of such threads, each polling its dead sockets: an idle rank
used 0.6 of a core, and the suite slowed down as it went (CI ran past its 90 minutes). ``gc.freeze()`` after each
collection keeps the next one to what the call allocated (tens of milliseconds instead of about a second). A rank
that still has a process-group thread after that (something holds a group past its call) is retired with its pool.

The launcher fails fast and loudly: a rank that raises sends its traceback home, the surviving ranks (probably stuck
in a collective waiting for it) are killed after a short grace period together with their pool (the next call starts
a fresh one), and the parent raises with every traceback it got.
"""

from __future__ import annotations

import atexit
import gc
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


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


def _run_task(fn, rank: int, world_size: int, port: int, args: tuple, init_group: bool, timeout: float) -> tuple:
    """One call on one rank: (rank, True, pickled result, 0) or (rank, False, traceback, 0). The call's process groups
    are destroyed and its layout handle and DTensor caches dropped (runtime.parallel.teardown), so the next call
    sees what a fresh rank would; the groups themselves are freed at the latest by ``shutdown`` when the rank exits."""
    from runtime.parallel.teardown import release_process_groups

    failure: BaseException | None = None
    try:
        os.environ.update(_rank_env(rank, world_size, port))
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        # Plain pickle bytes, not tensors: torch's queue would pass tensors as shared-memory handles that die with
        # the process that made them.
        return rank, True, pickle.dumps(fn(rank, world_size, *args)), 0
    except BaseException as exc:
        failure = exc
        return rank, False, traceback.format_exc(), 0
    finally:
        release_process_groups(failure=failure, collect=False)


def _worker(fn, rank: int, world_size: int, port: int, args: tuple, init_group: bool, timeout: float, results) -> None:
    """A one-shot rank (calls that create their own process group: init_group=False)."""
    from runtime.parallel.teardown import shutdown

    torch.set_num_threads(1)
    results.put(_run_task(fn, rank, world_size, port, args, init_group, timeout))
    shutdown(None)  # free the groups (join their threads) before the interpreter exits


def _pool_worker(rank: int, world_size: int, tasks, results) -> None:
    """A pooled rank: runs calls until it receives None. Each call gets the caller's environment and working
    directory, as a freshly spawned rank would; process state a call changed is reset after it."""
    from runtime.parallel.teardown import shutdown

    torch.set_num_threads(1)
    while True:
        task = tasks.get()
        if task is None:
            # what gc.freeze() kept out of collection must be collectable again: at exit, a frozen object of a
            # nanobind extension (triton's IR, imported by torch._dynamo) reads as a leak, 27 lines per rank
            gc.unfreeze()
            shutdown(None)  # free every call's groups (join their threads) before the interpreter exits
            return
        fn, port, args, timeout, environ, cwd = task
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        dtype = torch.get_default_dtype()
        try:
            rank_, ok, payload, _ = _run_task(fn, rank, world_size, port, args, True, timeout)
            results.put((rank_, ok, payload, _free_call_groups()))
        finally:
            torch.set_default_dtype(dtype)


def _free_call_groups() -> int:
    """Free the groups of the call that just ended (see the module docstring); the count of process-group threads
    still alive after that (0 unless something holds a group past its call)."""
    from runtime.parallel.teardown import comm_threads, release_process_groups

    release_process_groups(collect=True)
    gc.freeze()  # what survived is long-lived: the next collection scans only what the next call allocates
    return len(comm_threads())


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def _collect(procs: list[Any], results: Any, world_size: int, timeout: float) -> tuple[dict, dict, int]:
    """Every rank's (ok, payload) for one call, and the process-group threads the ranks still had after it; a rank
    that dies or outlives `timeout` counts as failed."""
    ok: dict[int, Any] = {}
    failed: dict[int, str] = {}
    left = 0
    deadline = time.monotonic() + timeout
    while len(ok) + len(failed) < world_size:
        now = time.monotonic()
        if now >= deadline:
            for rank in sorted(set(range(world_size)) - ok.keys() - failed.keys()):
                failed[rank] = f"rank {rank}: no result within {timeout:.0f} s (hung or too slow)"
            break
        try:
            rank, success, payload, threads = results.get(timeout=min(0.2, deadline - now))
        except queue_mod.Empty:
            for rank, p in enumerate(procs):
                if rank in ok or rank in failed or p.is_alive():
                    continue
                # A process that exited may still have a message in the pipe; give it one more look.
                try:
                    r, success, payload, threads = results.get(timeout=0.5)
                except queue_mod.Empty:
                    failed[rank] = f"rank {rank}: process died with exit code {p.exitcode} and sent no result"
                else:
                    (ok if success else failed)[r] = payload
                    left += threads
            continue
        (ok if success else failed)[rank] = payload
        left += threads
        if failed:
            deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    return ok, failed, left


class _Pool:
    """`world_size` spawned rank processes that run one call after another; ``env``: variables the ranks start with
    and every call keeps (the kernel levels of ``start_reordered``)."""

    def __init__(self, world_size: int, env: dict[str, str] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.env = env or {}
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_pool_worker, args=(rank, world_size, self.tasks[rank], self.results), daemon=True)
            for rank in range(world_size)
        ]
        saved = dict(os.environ)
        os.environ.update(self.env)  # a spawned child starts with the parent's environment at start()
        try:
            for p in self.procs:
                p.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def submit(self, fn: Callable[..., Any], args: tuple, timeout: float) -> None:
        port = _free_port()
        for queue in self.tasks:
            queue.put((fn, port, args, timeout, {**os.environ, **self.env}, os.getcwd()))

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> tuple[dict, dict, int]:
        self.submit(fn, args, timeout)
        return _collect(self.procs, self.results, self.world_size, timeout)

    def close(self) -> None:
        for queue in self.tasks:
            queue.put(None)
        for p in self.procs:
            p.join(timeout=5)
        self.kill()

    def kill(self) -> None:
        _kill(self.procs)
        for queue in (*self.tasks, self.results):
            queue.close()


_POOLS: dict[int | str, _Pool] = {}
_UNCOLLECTED: list[Callable[[], Any]] = []  # start_reordered's calls whose result nobody has collected yet


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def reordered_kernels() -> dict[str, str]:
    """Kernel settings that sum in other orders than this process's: the lowest level (ATen's default kernels, MKL's
    SSE2-compatible branch: tests/cpu_capabilities.py), or AVX2 where this process already runs the lowest."""
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        return {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    return {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}


def start_reordered(fn: Callable[..., Any], *args: Any, timeout: float = 300) -> Callable[[], Any]:
    """Start ``fn(0, 1, *args)`` on a one-rank process whose kernels sum in other orders (``reordered_kernels``) and
    return a function that waits for its result: the same computation as this process's ``fn(0, 1, *args)`` but for
    float32 rounding, the witness ``tests.tolerance`` measures a layout's rounding by. It runs while this process
    computes its own reference (both cores busy). A call whose result was never collected (its test failed first)
    is drained here, so its result cannot answer this one."""
    for stale in _UNCOLLECTED[:]:
        try:
            stale()
        except DistributedTestError:
            pass
    env = reordered_kernels()
    pool = _POOLS.get("reordered")
    if pool is None or not all(p.is_alive() for p in pool.procs) or pool.env != env:
        if pool is not None:
            pool.kill()
        pool = _POOLS["reordered"] = _Pool(1, env)
    pool.submit(fn, args, timeout)

    def result() -> Any:
        _UNCOLLECTED.remove(result)
        ok, failed, left = _collect(pool.procs, pool.results, 1, timeout)
        if failed or left:
            _POOLS.pop("reordered").kill()
        if failed:
            raise DistributedTestError(f"the reordered rank failed in {fn.__name__}:\n{failed[0]}")
        return pickle.loads(ok[0])

    _UNCOLLECTED.append(result)
    return result


def _run_pooled(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float) -> tuple[dict, dict]:
    pool = _POOLS.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.kill()
        pool = _POOLS[world_size] = _Pool(world_size)
    ok, failed, left = pool.run(fn, args, timeout)
    if failed:  # the survivors may be stuck in a collective: never reuse this pool
        _POOLS.pop(world_size).kill()
    elif left:  # a group outlived its call: its threads would poll on for the rest of the session
        _POOLS.pop(world_size).close()
    return ok, failed


def _run_once(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout: float, init_group: bool
) -> tuple[dict[int, Any], dict[int, str]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, args, init_group, timeout, results), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        ok, failed, _ = _collect(procs, results, world_size, timeout)  # these processes end here
        return ok, failed
    finally:
        _kill(procs)
        results.close()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120, init_group: bool = True
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results in rank order.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function); so must the return values, which should
    be small (CPU tensors, numbers, strings). The env carries RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
    MASTER_PORT like torchrun. The ranks are the session's shared pool for this world size (see the module
    docstring). With ``init_group=False`` the default process group is left for ``fn`` to create (e.g. to test
    init-from-env code): such a call gets fresh processes; the group is destroyed at the end either way. Ranks are
    daemonic processes, so ``fn`` cannot start processes of its own (e.g. DataLoader workers with
    ``num_workers > 0``).

    Raises ``DistributedTestError`` with every failing rank's traceback if any rank raises, crashes or hangs.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for attempt in range(_PORT_RETRIES):
        if init_group:
            ok, failed = _run_pooled(fn, world_size, args, timeout)
        else:
            ok, failed = _run_once(fn, world_size, args, timeout, init_group)
        if not failed:
            return [pickle.loads(ok[rank]) for rank in range(world_size)]
        # The free port can be taken between probing and binding it; that (only) is worth a retry.
        port_race = any("EADDRINUSE" in tb or "address already in use" in tb.lower() for tb in failed.values())
        if not port_race or attempt == _PORT_RETRIES - 1:
            break
    report = "\n".join(f"----- rank {rank} -----\n{tb}" for rank, tb in sorted(failed.items()))
    raise DistributedTestError(f"{len(failed)} of {world_size} ranks failed in {fn.__name__}:\n{report}")
