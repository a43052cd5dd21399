"""``python -m bench.gpu_check [--out DIR] [--dry-run] [--only STEP ...]`` (see ``bench/gpu_check/__init__.py``).

Each step runs under its own time budget (seconds, sized so the whole stays under 8 minutes on one H100); a step
that cannot run is recorded ``skipped: <reason>``, one that fails ``failed: <error>``, and the command goes on. The
exit status is 1 if any step failed. Results: ``results.json`` and ``results.md`` in ``--out``, and a table printed
last.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "bench" / "results" / "gpu_check"


@dataclass(frozen=True)
class Step:
    name: str
    module: str  # bench.gpu_check.<module>.run(ctx), or "pytest" for the CUDA tests
    budget: int  # seconds on one H100/H200 (the dry run only guards against a hang: DRY_RUN_GUARD)


# Budgets add up to 450 s (7.5 min) on the GPU: the CUDA tests first (they decide whether the figures mean anything).
STEPS = (
    Step("cuda tests (pytest -m gpu)", "pytest", 150),
    Step("dense LM step, generated vs upstream", "measure_dense", 50),
    Step("MoE experts fwd+bwd", "measure_moe", 40),
    Step("Wan DiT step, generated vs diffusers", "measure_dit", 50),
    Step("FlowGRPO iteration", "measure_flowgrpo", 70),
    Step("plan estimate vs measured peak", "measure_plan", 90),  # two fake-tensor traces on the host CPU
)
# The dry run runs inside `make test` on a shared CPU machine: a budget there would be a wall-clock assertion that a
# loaded machine fails, so it only stops a step that hangs.
DRY_RUN_GUARD = 600


class BudgetExceeded(Exception):
    pass


@contextmanager
def budget(seconds: int) -> Iterator[None]:
    """Raise ``BudgetExceeded`` in this (main) thread after ``seconds``: a step cannot eat the others' time."""

    def alarm(signum: int, frame: Any) -> None:
        raise BudgetExceeded(f"over its {seconds} s budget")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_pytest(out: Path, cuda: bool, seconds: int) -> dict[str, Any]:
    """tests/gpu under ``-m gpu`` in a fresh interpreter (``TRITON_INTERPRET=0`` on CUDA: the compiled kernels),
    with a JUnit XML report read back into counts; on CPU every test reports skipped with its reason."""
    from bench.gpu_check.junit import summary

    xml = out / "pytest-gpu.xml"
    env = {**os.environ, "TRITON_INTERPRET": "0" if cuda else "1", "HF_HUB_OFFLINE": "1"}
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS: the bitwise parity and resume tests
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs"]
    cmd += [f"--junitxml={xml}", "-o", "addopts="]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=seconds)
    (out / "pytest-gpu.log").write_text(done.stdout + done.stderr)
    result = summary(xml)
    result["returncode"] = done.returncode
    result["status"] = "ok"
    result["summary"] = f"{result['passed']} passed, {result['failed']} failed, {result['skipped']} skipped"
    if done.returncode not in (0, 5) or result["failed"]:
        result["status"] = "failed"
        result["error"] = f"pytest -m gpu: {result['summary']}, rc {done.returncode} (pytest-gpu.log)"
        result["trace"] = (done.stdout + done.stderr)[-4000:]
    elif not cuda:
        result["status"] = "skipped"
        result["reason"] = f"no CUDA device: {result['skipped']} gpu tests collected and reported skipped"
    return result


def run_step(step: Step, ctx: Any, out: Path) -> dict[str, Any]:
    """One step's record: status ok / skipped / failed, its seconds and what it measured."""
    from bench.gpu_check.common import Skipped, release

    seconds = step.budget if ctx.cuda else DRY_RUN_GUARD
    start = time.perf_counter()
    record: dict[str, Any] = {"step": step.name, "budget_s": seconds}
    try:
        release(ctx.device)
        if step.module == "pytest":
            record.update(run_pytest(out, ctx.cuda, seconds))
        else:
            with budget(seconds):
                module = importlib.import_module(f"bench.gpu_check.{step.module}")
                record.update(status="ok", **module.run(ctx))
    except Skipped as exc:
        record.update(status="skipped", reason=str(exc))
    except Exception as exc:  # recorded, and the next step runs
        record.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:500], trace=traceback.format_exc())
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT})")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU; CUDA-only parts report skipped")
    parser.add_argument("--only", nargs="+", metavar="MODULE", help="run only these steps (pytest, measure_dense ...)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per measurement (default 5, dry 1)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only or ()) - {step.module for step in STEPS})
    if unknown:  # a typo would otherwise run nothing and exit 0
        known = ", ".join(step.module for step in STEPS)
        print(f"gpu_check: --only {' '.join(unknown)}: no such step; the steps are {known}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))

    import torch

    from bench.gpu_check.common import Context
    from bench.gpu_check.env import pins, versions
    from bench.gpu_check.report import write

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("gpu_check: no CUDA device here; running the dry run (tiny sizes on CPU)", flush=True)
    ctx = Context(
        torch.device("cuda" if cuda else "cpu"), "real" if cuda else "tiny", args.repeats or (5 if cuda else 1)
    )
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    records = []
    for step in STEPS:
        if args.only and step.module not in args.only:
            continue
        print(f"gpu_check: {step.name} ...", flush=True)
        records.append(run_step(step, ctx, args.out))
        print(f"gpu_check:   {records[-1]['status']} in {records[-1]['seconds']} s", flush=True)
    results = {
        "mode": "gpu" if cuda else "dry-run",
        "size": ctx.size,
        "versions": versions(),
        "pins": pins(),
        "total_seconds": round(time.perf_counter() - started, 1),
        "steps": records,
    }
    print(write(results, args.out), flush=True)
    return 1 if any(r["status"] == "failed" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
