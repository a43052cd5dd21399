"""Teardown stress: run 2-rank torchrun jobs many times under a CPU-burning load and count the ranks that abort.

``make demo`` once died with ``terminate called without an active exception`` (SIGABRT) in rank 1 of
``runtime.demos.sp_parity`` as the rank exited, on a loaded 2-core machine: a race between gloo's threads and
interpreter finalization (``runtime/parallel/teardown.py`` explains it). This runs the jobs that end that way, each
``--runs`` times, while ``--load`` busy-loop processes compete for the CPUs, and sorts every run into ok, abort (a
rank killed by SIGABRT or ``terminate called`` in its output), timeout, or another failure. Exit code 1 if any run
aborted.

    python bench/teardown_stress.py --runs 20                  # sp_parity and a tiny runtime.train job, 2 burners
    python bench/teardown_stress.py --root /tmp/old --runs 20  # the same against another checkout (before a fix)

Scenarios: ``sp_parity`` (``torchrun -m runtime.demos.sp_parity``, `make demo` section 2) and ``train`` (``torchrun -m
runtime.train`` on tiny qwen3, sp=2, 3 steps, as runtime/demos/train_text.py writes it); ``inflight`` (not run by
default) is the race at its widest, a rank that exits with gloo collectives in flight (without ``shutdown`` most such
runs abort; that is how the cause was found and shown, see runtime/parallel/teardown.py). Logs of the runs that were
not ok go to ``--keep``; ``--cores`` lets the ranks dump core there too (``gdb python core`` then ``bt``: the C++
stack of an abort). Every process this starts is ended before it returns.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/teardown_stress.py` from the repository root

from runtime.demos.train_text import MODEL  # noqa: E402
from runtime.tiny import write_tokenizer  # noqa: E402

OUTCOMES = ("ok", "abort", "timeout", "failed")
ABORT_MARKERS = ("terminate called", "Fatal Python error: Aborted", "SIGABRT", "Signal 6 ")


def classify(returncode: int | None, output: str, expect: str | None = None) -> str:
    """One run's outcome from its exit code (None: it timed out) and its combined output."""
    if any(marker in output for marker in ABORT_MARKERS) or returncode in (-signal.SIGABRT, 128 + signal.SIGABRT):
        return "abort"
    if returncode is None:
        return "timeout"
    if returncode != 0 or (expect is not None and expect not in output):
        return "failed"
    return "ok"


def train_config(work: Path) -> Path:
    """A tiny 2-rank text run (sp=2, 3 steps, nothing saved): the shortest job with FSDP2, SP and a mesh."""
    from runtime.data.text.corpus import corpus_path

    if not (work / "tokenizer").exists():
        write_tokenizer(work / "tokenizer")
    raw = {
        "model": {"type": "qwen3", "config": MODEL, "seed": 0},
        "data": {"path": str(corpus_path()), "tokenizer": str(work / "tokenizer"), "token_budget": 256},
        "parallel": {"sp": 2},
        "optim": {"lr": 4e-3, "warmup_steps": 1},
        "train": {"steps": 3, "loss_chunk_size": 256},
        "checkpoint": {"dir": str(work / "ckpt"), "interval": 0},
        "log": {"dir": str(work / "log"), "progress": False, "interval": 1},
        "export": {"dir": None},
    }
    path = work / "train.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


# The mechanism alone, at its widest: exit with gloo collectives in flight, the groups held by the layout handle as
# in every job. It ends through the checkout's teardown when it has one; a checkout from before it just exits.
INFLIGHT = """\
import torch
import torch.distributed as dist

from runtime.parallel.state import init_parallel_state

torch.set_num_threads(1)
state = init_parallel_state(sp_size=2)
works = [dist.all_reduce(torch.randn(1 << 16), group=state.sp_group, async_op=True) for _ in range(8)]
del works, state
try:
    from runtime.parallel.teardown import shutdown
except ImportError:
    pass
else:
    shutdown(None)
print("PASS", flush=True)
"""


def scenarios(work: Path) -> dict[str, tuple[list[str], str | None]]:
    """Name -> (the torchrun arguments after ``--nproc-per-node 2``, a line the output must hold)."""
    (work / "inflight.py").write_text(INFLIGHT)
    return {
        "sp_parity": (["-m", "runtime.demos.sp_parity"], "PASS"),
        "train": (["-m", "runtime.train", str(train_config(work))], None),
        "inflight": ([str(work / "inflight.py")], "PASS"),
    }


def _enable_cores() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run_once(args: list[str], root: Path, cwd: Path, timeout: float, cores: bool) -> tuple[int | None, str]:
    """One ``torchrun --standalone --nproc-per-node 2 ARGS`` in its own session (so a timeout ends all of it)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",  # a rank's last lines are in the log even when it dies
        "PYTHONFAULTHANDLER": "1",  # on SIGABRT, every Python thread's stack
        "PYTHONPATH": str(root),
    }
    proc = subprocess.Popen(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_enable_cores if cores else None,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): leave no rank behind
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def start_load(count: int) -> list[subprocess.Popen]:
    """``count`` busy-loop processes: a loaded machine is where the teardown race showed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait()


def stress(
    names: list[str], runs: int, root: Path, keep: Path, timeout: float, cores: bool, report: Callable[[str], None]
) -> dict[str, Counter]:
    """Run each scenario ``runs`` times (interleaved); the outcome counts per scenario."""
    counts = {name: Counter() for name in names}
    with tempfile.TemporaryDirectory(prefix="teardown-stress-") as scratch:
        table = scenarios(Path(scratch))
        for i in range(1, runs + 1):
            for name in names:
                args, expect = table[name]
                cwd = keep / f"{name}-{i:03d}"
                cwd.mkdir(parents=True, exist_ok=True)
                start = time.monotonic()
                returncode, output = run_once(args, root, cwd, timeout, cores)
                outcome = classify(returncode, output, expect)
                counts[name][outcome] += 1
                report(f"{name:<10} run {i:>3}/{runs}: {outcome:<7} rc={returncode} {time.monotonic() - start:6.1f} s")
                if outcome == "ok":
                    for path in cwd.iterdir():
                        path.unlink()
                    cwd.rmdir()
                else:
                    (cwd / "output.txt").write_text(output)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per scenario (default 20)")
    parser.add_argument("--load", type=int, default=2, help="busy-loop processes beside the runs (default 2)")
    parser.add_argument("--scenarios", default="sp_parity,train", help="comma-separated: sp_parity, train, inflight")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose runtime runs (default: this one)")
    parser.add_argument("--keep", type=Path, default=None, help="where logs of runs that were not ok go")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take (default 600)")
    parser.add_argument("--cores", action="store_true", help="let the ranks dump core into --keep")
    args = parser.parse_args(argv)
    names = [n for n in args.scenarios.split(",") if n]
    unknown = sorted(set(names) - {"sp_parity", "train", "inflight"})
    if unknown or args.runs < 1 or args.load < 0:
        parser.error(f"bad --scenarios ({', '.join(unknown)}) or --runs/--load" if unknown else "--runs/--load")
    keep = args.keep or Path(tempfile.mkdtemp(prefix="teardown-stress-logs-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # `timeout` too ends the load
    print(f"{args.runs} runs x {names} under {args.load} busy-loop process(es), code from {args.root}", flush=True)
    load = start_load(args.load)
    try:
        report = functools.partial(print, flush=True)
        counts = stress(names, args.runs, args.root.resolve(), keep, args.timeout, args.cores, report)
    finally:
        stop(load)
    print(f"{'scenario':<10} " + " ".join(f"{o:>8}" for o in OUTCOMES))
    for name, count in counts.items():
        print(f"{name:<10} " + " ".join(f"{count[o]:>8}" for o in OUTCOMES))
    if any(count["abort"] or count["timeout"] or count["failed"] for count in counts.values()):
        print(f"logs of the runs that were not ok: {keep}")
    return 1 if any(count["abort"] for count in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
