"""Process teardown: every process that made a process group frees it, and joins its threads, before exit.

Why this exists (``make demo`` once died with ``terminate called without an active exception`` / SIGABRT in rank 1
of ``runtime.demos.sp_parity`` after printing PASS, on a loaded 2-core machine): ``destroy_process_group`` only
*unregisters* the groups. A gloo group's worker threads (``pt_gloo_runloop``) and its transport thread
(``gloo_tcp_loop``) live as long as the ``ProcessGroup`` object, and every ``DeviceMesh`` keeps its groups in
``_pg_registry``. Our layout handle (``runtime.parallel.state._STATE``) holds the meshes, the meshes form reference
cycles (a sub-mesh points at its root, the root at its flattened sub-meshes) and torch's DTensor caches hold meshes
too, so the groups and their threads outlived ``destroy_process_group`` into interpreter finalization. A gloo
worker thread destroys a finished work (and the tensors it holds) only *after* it has woken the caller; when that
happens once the main thread is in ``Py_FinalizeEx``, the core dump's stack reads ``ProcessGroupGloo::runLoop`` ->
``~AsyncAllreduceWork`` -> ``TensorImpl::decref_pyobject`` -> ``gil_scoped_acquire`` -> ``take_gil`` ->
``PyThread_exit_thread`` -> ``pthread_exit`` -> forced unwind through the (noexcept) destructor -> ``std::terminate``.
Exiting with a collective still in flight aborts the same way. The fix is not to get there: ``shutdown`` drops
every reference we and torch's caches hold, collects the cycles while the interpreter is whole, so each group's
destructor joins its threads, and checks that none is left (docs/architecture.md, "Process teardown").

Every entry point goes through here: ``runtime.cli.run_command`` (``runtime.train``, ``runtime.train.prepare``,
``runtime.rl``), the torchrun demos (``with torn_down(): main()``) and the test ranks of ``tests/dist_utils``.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from runtime import torch_compat
from runtime.parallel.state import set_parallel_state

# Thread names (``/proc/<pid>/task/*/comm``, 15 characters) of the native threads a process group owns: gloo's
# worker and transport threads, NCCL's watchdog and heartbeat monitor.
COMM_THREAD_MARKERS = ("gloo", "nccl")
DEFAULT_BARRIER_TIMEOUT_S = 120.0


def native_thread_names() -> list[str]:
    """The names of this process's OS threads (Linux ``/proc``; empty elsewhere, where nothing is checked)."""
    names = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended while we looked
            continue
    return names


def comm_threads() -> list[str]:
    """Native threads that belong to a process group; empty once every group was freed."""
    return [name for name in native_thread_names() if any(m in name.lower() for m in COMM_THREAD_MARKERS)]


def _drop_mesh_groups() -> None:
    """Empty the group registry of every live ``DeviceMesh``: after ``destroy_process_group`` a mesh is dead, but
    torch's caches keep meshes (``MeshTopoInfo.build_from_mesh``'s lru_cache, the redistribute planners, the
    sharding caches) and with them, through ``_pg_registry``, the groups and their threads. One sweep finds the
    meshes wherever they are held, instead of a list of private caches that changes with each torch release."""
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        if DeviceMesh in type(obj).__mro__:  # not isinstance: that reads ``__class__``, which some objects warn on
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()


def _clear_exception_frames(failure: BaseException | None) -> None:
    """Drop the locals of the frames a failure's traceback (and its chained ones) keeps alive: a model, a state or
    a mesh there would keep its process groups alive until finalization. Line numbers and code stay printable."""
    seen: set[int] = set()
    while failure is not None and id(failure) not in seen:
        seen.add(id(failure))
        traceback.clear_frames(failure.__traceback__)
        failure = failure.__cause__ or failure.__context__


def _barrier(timeout_s: float) -> None:
    """Wait for every rank (bounded), so that no rank frees its end of a connection a peer still reads from."""
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    else:
        dist.barrier()


def release_process_groups(
    barrier_timeout_s: float | None = None, failure: BaseException | None = None, collect: bool = True
) -> None:
    """Destroy the process groups and free them now (their destructors join their threads).

    ``barrier_timeout_s``: meet the other ranks first (None: don't; never after a failure, when a peer may be stuck
    in a collective that cannot complete). A barrier that fails or times out is reported on stderr and teardown goes
    on: the local groups must be freed either way. ``collect=False`` drops the references but leaves the cycles to
    Python's collector (a reused test rank between calls: a full collection costs about 0.2-0.7 s on 2 cores)."""
    if dist.is_available() and dist.is_initialized():
        if barrier_timeout_s is not None and failure is None:
            try:
                _barrier(barrier_timeout_s)
            except RuntimeError as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                print(f"warning: teardown barrier failed, tearing down anyway: {first}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
    set_parallel_state(None)
    if dist.is_available():
        # a mesh compares equal to any mesh of the same layout whatever its groups: a reused rank's next call would
        # get cached specs holding this call's destroyed groups ("Could not resolve the process group ...")
        torch_compat.clear_dtensor_caches()
    _clear_exception_frames(failure)
    if collect:
        gc.collect()  # the meshes form cycles: only the collector frees them, and with them the groups
        if dist.is_available():
            _drop_mesh_groups()


def flush_stdio() -> None:
    """Flush Python's stdout/stderr so a rank's last lines are out before it exits."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can be said there
            pass


def shutdown(
    barrier_timeout_s: float | None = DEFAULT_BARRIER_TIMEOUT_S, failure: BaseException | None = None
) -> list[str]:
    """The end of every process that may have made a process group: barrier (bounded, success only), destroy, free,
    flush. Returns the process-group threads still alive (empty: nothing left to race finalization); a non-empty
    list is also reported on stderr, since something still holds a group."""
    release_process_groups(barrier_timeout_s, failure)
    left = comm_threads()
    if left:
        print(
            f"warning: pid {os.getpid()}: {len(left)} process-group thread(s) still alive after teardown "
            f"({', '.join(sorted(set(left)))}): something still references a process group",
            file=sys.stderr,
        )
    flush_stdio()
    return left


@contextmanager
def torn_down(barrier_timeout_s: float | None = DEFAULT_BARRIER_TIMEOUT_S) -> Iterator[None]:
    """Run a block (an entry point's ``main``) and ``shutdown`` after it, whatever happens; after a failure with no
    barrier, and the failure's frames cleared so that their locals free their groups too."""
    try:
        yield
    except SystemExit as exc:
        if exc.code in (0, None):  # a main that ends with sys.exit(0) succeeded
            shutdown(barrier_timeout_s)
        else:
            shutdown(None, failure=exc)
        raise
    except BaseException as exc:
        shutdown(None, failure=exc)
        raise
    shutdown(barrier_timeout_s)
