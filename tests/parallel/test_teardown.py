"""Process teardown (runtime/parallel/teardown.py): after ``shutdown`` no process-group thread is left to race
interpreter finalization, whereas ``destroy_process_group`` alone leaves gloo's threads running (the cause of the
``terminate called without an active exception`` abort). The many-run proof under load is
``bench/teardown_stress.py`` (minutes per run on 2 cores; docs/architecture.md has its figures); these are the
deterministic checks behind it, a few seconds on the shared test ranks."""

from __future__ import annotations

import importlib.util
import signal
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from runtime.cli import run_command
from runtime.parallel.state import get_parallel_state, init_parallel_state, set_parallel_state
from runtime.parallel.teardown import comm_threads, shutdown, torn_down
from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[2]
LINUX_THREADS = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")


# The thread checks run on fresh ranks (``init_group=False``; ``init_parallel_state`` makes the group from the env, as
# under torchrun): a pooled rank also holds what earlier tests of the session left referencing their groups.


def _sp_step() -> torch.Tensor:
    """A layout with meshes and one collective on the SP group: what sp_parity does before it ends."""
    state = init_parallel_state(sp_size=2)
    grad = torch.ones(4) * (state.rank + 1)
    dist.all_reduce(grad, group=state.sp_group)
    return grad


def _destroy_then_shutdown(rank: int, world_size: int) -> tuple[list[str], list[str]]:
    _sp_step()
    dist.destroy_process_group()
    after_destroy = comm_threads()  # the handle's meshes still hold the groups, so gloo's threads run on
    return after_destroy, shutdown(None)


@LINUX_THREADS
@pytest.mark.dist
def test_destroy_process_group_alone_leaves_gloo_threads_shutdown_joins_them() -> None:
    for after_destroy, after_shutdown in run_distributed(_destroy_then_shutdown, 2, init_group=False):
        assert any("gloo" in name for name in after_destroy), after_destroy
        assert after_shutdown == []


class _Holder:
    """Stands for a model a run keeps in a local variable."""


def _command_rank(rank: int, world_size: int, fail: bool) -> tuple[int | str, list[str], bool, bool]:
    held: list[weakref.ref] = []

    def run(config: Any) -> None:
        holder = _Holder()
        held.append(weakref.ref(holder))
        _sp_step()
        if fail:
            raise RuntimeError("a run that fails after its collectives")

    argv = ["run.yaml"]
    try:
        code: int | str = run_command(argv, command="x", about="", references=[], load=lambda *_: None, run=run)
    except RuntimeError as exc:
        code = str(exc)
    return code, comm_threads(), held[0]() is None, get_parallel_state().mesh is None


@LINUX_THREADS
@pytest.mark.dist
@pytest.mark.parametrize("fail", [False, True], ids=["success", "failure"])
def test_run_command_frees_the_groups_on_success_and_failure(fail: bool) -> None:
    """Every entry point (runtime.train, runtime.rl, runtime.train.prepare) ends through run_command; after it no
    gloo thread is left, and after a failure the frames of its traceback no longer hold the run's objects."""
    for code, threads, holder_freed, handle_reset in run_distributed(_command_rank, 2, fail, init_group=False):
        assert code == ("a run that fails after its collectives" if fail else 0)
        assert threads == []
        assert holder_freed and handle_reset


def _pooled_sp_step(rank: int, world_size: int) -> None:
    _sp_step()  # leaves the layout's meshes (reference cycles holding their groups) to the teardown


def _transport_threads(rank: int, world_size: int) -> int:
    """gloo's transport threads: one per live group (its worker threads name themselves only once they run)."""
    return comm_threads().count("gloo_tcp_loop")


@LINUX_THREADS
@pytest.mark.dist
def test_pooled_ranks_free_each_calls_groups() -> None:
    """The shared test ranks (tests/dist_utils) free a call's groups before the next: without that, each call left
    its gloo transport threads polling for the rest of the session and the suite slowed down as it ran."""
    counts = []
    for _ in range(3):
        run_distributed(_pooled_sp_step, 2)
        counts.append(run_distributed(_transport_threads, 2))
    assert counts == [[1, 1]] * 3, counts  # the call's own default group only


def test_torn_down_frees_a_failures_locals_and_reraises() -> None:
    held: list[weakref.ref] = []

    def main() -> None:
        holder = _Holder()
        held.append(weakref.ref(holder))
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        with torn_down():
            main()
    assert held[0]() is None
    set_parallel_state(None)


def test_torn_down_lets_a_clean_exit_through() -> None:
    with pytest.raises(SystemExit) as exc:
        with torn_down():
            raise SystemExit(0)
    assert exc.value.code == 0


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("teardown_stress", ROOT / "bench" / "teardown_stress.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "returncode, output, expect, outcome",
    [
        (0, "PASS\n", "PASS", "ok"),
        (0, "", None, "ok"),
        (-signal.SIGABRT, "", None, "abort"),
        (1, "PASS\nterminate called without an active exception\n", "PASS", "abort"),
        (1, "exitcode  : -6 (pid: 12)\ntraceback : Signal 6 (SIGABRT) received by PID 12", None, "abort"),
        (None, "", None, "timeout"),
        (0, "FAIL (tolerance 1e-5)", "PASS", "failed"),
        (2, "error: bad key", None, "failed"),
    ],
)
def test_stress_bench_sorts_runs(returncode: int | None, output: str, expect: str | None, outcome: str) -> None:
    assert _bench().classify(returncode, output, expect) == outcome
