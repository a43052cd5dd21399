"""Session-wide test setup.

``TRITON_INTERPRET=1`` before anything imports triton: triton decorates its own standard library (``tl.zeros``, ...)
when ``triton.language`` is first imported, so the interpreter must be on by then for the Triton MoE kernels to run
on CPU tensors (``tests/gpu_readiness/test_triton_moe.py``). Spawned test ranks inherit it. ``TRITON_INTERPRET=0``
in the environment keeps the compiled kernels (a CUDA machine: the same tests then run on the GPU).
"""

import dis
import importlib
import inspect
import os
import sys
import types
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


# ------------------------------------------------------------------------------------------------ the fast tier
# `make test-fast` runs `pytest -m "not slow"`. A test is `slow` when it starts other processes: torch.distributed
# ranks (tests/dist_utils.run_distributed, any world size: each call is an end-to-end job on spawned ranks) or a
# new Python interpreter (`sys.executable`, torchrun: seconds of imports each). Found here by reading the code the
# test runs (its function, its fixtures, and the tests/ helpers they call, transitively), so a new test lands in
# the right tier without anyone marking it. tests/slow_tests.txt lists the single-process tests measured too long
# for the edit loop. `make test` runs both tiers.
_SPAWN_NAMES = frozenset({"run_distributed", "executable"})  # executable: sys.executable, a new interpreter
_SPAWN_STRINGS = ("torchrun",)


def _read_long() -> frozenset[str]:
    """tests/slow_tests.txt: test modules and test functions (node ids without parameters), comments dropped."""
    text = (Path(__file__).parent / "slow_tests.txt").read_text()
    return frozenset(entry for line in text.splitlines() if (entry := line.split("#", 1)[0].strip()))


LONG = _read_long()


def _code_objects(code: types.CodeType) -> list[types.CodeType]:
    """``code`` and every code object nested in it (inner functions, lambdas, comprehensions)."""
    found, stack = [], [code]
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    return found


_CALLEES: dict[types.CodeType, list[object]] = {}  # disassembling is the cost: each code object once per session


def _callees(fn: types.FunctionType, code: types.CodeType) -> list[object]:
    """The objects ``code`` names: its globals, and what it imports inside a function (``from m import f``)."""
    if code not in _CALLEES:
        _CALLEES[code] = _named(fn, code)
    return _CALLEES[code]


def _named(fn: types.FunctionType, code: types.CodeType) -> list[object]:
    named = [fn.__globals__.get(name) for name in code.co_names]
    module = None
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME":  # a tests/ helper module may not be imported yet
            module = sys.modules.get(ins.argval)
            if module is None and ins.argval.startswith("tests."):
                try:
                    module = importlib.import_module(ins.argval)
                except ImportError:  # the test's own import fails (or skips) it when it runs
                    module = None
        elif ins.opname == "IMPORT_FROM" and module is not None:
            named.append(getattr(module, ins.argval, None))
    return named


def _spawns(fn: object, seen: set[types.CodeType]) -> bool:
    """Whether ``fn`` (or a tests/ function it calls) starts ranks or an interpreter."""
    fn = inspect.unwrap(fn) if callable(fn) else fn
    if not isinstance(fn, types.FunctionType) or fn.__code__ in seen:
        return False
    seen.add(fn.__code__)
    for code in _code_objects(fn.__code__):
        if _SPAWN_NAMES.intersection(code.co_names):
            return True
        if any(isinstance(c, str) and any(s in c for s in _SPAWN_STRINGS) for c in code.co_consts):
            return True
        for callee in _callees(fn, code):
            if getattr(callee, "__module__", "").startswith("tests") and _spawns(callee, seen):
                return True
    return False


def _is_slow(item: pytest.Item) -> bool:
    module, function = item.nodeid.split("::", 1)[0], item.nodeid.split("[", 1)[0]
    if item.get_closest_marker("dist") or module in LONG or function in LONG:
        return True
    seen: set[types.CodeType] = set()
    fixtures = getattr(item, "_fixtureinfo", None)
    defs = fixtures.name2fixturedefs.values() if fixtures is not None else ()
    ours = [d[-1].func for d in defs if d[-1].func.__module__.startswith("tests")]  # not pytest's own fixtures
    return any(_spawns(f, seen) for f in [getattr(item, "function", None), *ours])


# `make test` runs pytest-xdist with two workers, one test file per worker at a time (`--dist loadfile`: a module's
# fixtures, e.g. one spawned world for all its cases, are built once). Files are handed out in collection order, so
# the longest go first, longest to shortest (a long file started last would leave the other core idle at the end):
# the files over about 80 s summed on two workers, measured 2026-12-07 with `--durations=0` (under load 7-9, so 2-3x
# an idle run's figures; their order is what counts), the drafted models' trainer placed by its own runs; the rest
# keep their order.
LONGEST_FIRST = (
    "tests/gpu_readiness/test_compile.py",
    "tests/engine/test_verify.py",
    "tests/gpu_readiness/test_plan.py",
    "tests/train/test_dit_models.py",
    "tests/rl/test_algorithms.py",
    "tests/rl/test_job_dist.py",
    "tests/train/test_drafted_trainer.py",
    "tests/train/test_cli.py",
    "tests/engine/test_cli.py",
    "tests/rl/test_job.py",
    "tests/hostile/test_train_round5.py",
    "tests/train/test_vlm_trainer.py",
    "tests/rl/test_diffusionopd.py",
    "tests/parity/test_moe_parallel.py",
    "tests/engine/test_migrate.py",
    "tests/fidelity/test_generate.py",
    "tests/dit/test_pipelines.py",
    "tests/parallel/test_teardown.py",
    "tests/rl/test_new_dits.py",
    "tests/engine/test_upgrade_report.py",
    "tests/train/test_lm_structures_trainer.py",
    "tests/rl/test_dpo.py",
    "tests/dit/test_sp.py",
    "tests/hostile/test_train_nonfinite.py",
    "tests/rl/test_algorithms_models.py",
    "tests/train/test_self_check.py",
    "tests/train/test_tiny_cli.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the multi-process and long tests ``slow`` (the fast tier's selection, see above); the longest files
    first (``LONGEST_FIRST``; the order within a file is kept)."""
    if "slow" in (config.option.markexpr or ""):  # only a selection by tier reads the mark (12 s of reading code)
        for item in items:
            if not item.get_closest_marker("slow") and _is_slow(item):
                item.add_marker(pytest.mark.slow)
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``gpu``-marked tests (tests/gpu, run by ``make gpu-check``) skip with the reason where there is no CUDA."""
    if item.get_closest_marker("gpu"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip("gpu: no CUDA device here (torch.cuda.is_available() is False)")
