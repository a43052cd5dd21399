"""``python -m runtime.plan cfg.yaml [more.yaml ...] --gpus 64 [8 ...] --gpu-mem 80 [--parallel.sp=2 ...]``: per-rank
memory of the configured layout, the first layout that fits (least recomputation and communication) and its
runners-up (see ``runtime/plan/__init__.py``, ``choice.py``). Dotted overrides set keys of every plan file, as
``runtime.train``'s set a run config's. Progress goes to stderr, one line per stage of the measurement (tens of
seconds for a real size), when stderr is a terminal or with ``--progress`` (as git does: a log of errors stays
errors only). ``--help`` and a bad plan file cost no torch import. User errors (a bad argument or
override, every problem of every plan file) are each one ``error:`` line, all reported at once, with exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence

from runtime.config.overrides import Override, OverrideError, parse_overrides
from runtime.config.yaml_file import ConfigLoader
from runtime.plan.config import ConfigError, PlanConfig, read_plan

GIB = 2**30
MAX_GPUS = 2**20  # device counts: ten times the largest clusters (the layout search stays in seconds below it)
MAX_GPU_COUNTS = 64  # --gpus values of one command
MAX_GPU_MEM = 2**20  # GiB per device (a thousand times today's largest)
USAGE = (
    "python -m runtime.plan cfg.yaml [more.yaml ...] [--gpus N [N ...]] [--gpu-mem GIB] [--table] [--progress] "
    "[--section.key=VALUE ...]"
)
_BARE_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+=")  # ``parallel.sp=2``: an override without its --
USER_ERROR = 2


class UsageError(Exception):
    """A command line argparse cannot read (reported in one line, not argparse's usage block)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]  # argparse exits with its usage block
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m runtime.plan",
        usage=USAGE,
        description="Per-rank memory (parameters, gradients, optimizer, gathered parameters, activations) of a "
        "training step of a real-size model under an FSDP2/HSDP/SP/EP/activation-checkpointing layout, computed on "
        "fake tensors, and the first layout that fits (least recomputation and communication first, not least "
        "memory) with its runners-up. Plan files: runtime/plan/configs/*.yaml. --section.key=VALUE (or "
        "--section.key VALUE) sets a key of every plan file, read as YAML: --parallel.sp=2 --workload.tokens=4096.",
    )
    parser.add_argument("configs", nargs="+", metavar="cfg.yaml", help="plan files (model, workload, parallel)")
    parser.add_argument("--gpus", type=int, nargs="+", default=[8], help="device counts to plan for (default 8)")
    parser.add_argument("--gpu-mem", type=float, default=80.0, help="memory per device in GiB (default 80)")
    parser.add_argument("--table", action="store_true", help="one markdown row per model and device count")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a stderr line per stage of each measurement (default: when stderr is a terminal)",
    )
    return parser


def _configured(plan: PlanConfig, gpus: int):
    from runtime.plan.layout import Layout

    p = plan.parallel
    rest = p.dp_replicate * p.sp
    dp_shard = p.dp_shard if p.dp_shard is not None else gpus // rest
    return Layout(p.dp_replicate, dp_shard, p.sp, p.ep, p.activation_checkpointing)


def _row(memory) -> str:
    parts = ("params", "grads", "optimizer", "gathered", "activations")
    return (
        ", ".join(f"{name} {getattr(memory, name) / GIB:.1f}" for name in parts)
        + f"; total {memory.total / GIB:.1f} GiB"
    )


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[Override]]:
    """(the arguments argparse reads, the dotted overrides ``--section.key=VALUE`` / ``--section.key VALUE`` read as
    ``runtime.train`` reads them); ``OverrideError`` for a malformed one, or one typed without its ``--``."""
    rest: list[str] = []
    typed: list[str] = []
    argv = list(argv)
    while argv:
        arg = argv.pop(0)
        if _BARE_OVERRIDE.match(arg):
            raise OverrideError(f"{arg!r}: an override is written --{arg}")
        if arg.startswith("--") and "." in arg.partition("=")[0]:
            typed.append(arg)
            if "=" not in arg and argv and not argv[0].startswith("--"):
                typed.append(argv.pop(0))
        else:
            rest.append(arg)
    return rest, parse_overrides(typed, ConfigLoader)


def _progress(path: str, started: float, on: bool) -> Callable[[str], None]:
    """One stderr line per stage of a plan's measurement, with the seconds since its start (``on``)."""

    def say(stage: str) -> None:
        if on:
            print(f"plan: {path}: {stage} (at {time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)

    return say


def _report(
    plan: PlanConfig, gpus_list: list[int], gpu_mem: float, table: bool, path: str = "", progress: bool = False
) -> list[str]:
    say = _progress(path or plan.model.name or plan.model.type, time.monotonic(), progress)
    say("importing torch")
    from runtime.plan.choice import RUNNERS_UP, choice_lines
    from runtime.plan.footprint import measure
    from runtime.plan.layout import USABLE, candidates, fitting, per_rank, valid

    fp = measure(plan, progress=say)
    say("measured; per-rank memory of every candidate layout")
    usable = USABLE * gpu_mem * GIB
    lines = []
    if not table:
        experts = f", {fp.expert_params / 1e9:.2f} B in routed experts ({fp.experts} per layer)" if fp.experts else ""
        lines.append(
            f"{fp.name} ({plan.model.type}): {fp.params / 1e9:.2f} B parameters{experts}, "
            f"{len(fp.saved_blocks)} blocks, {fp.tokens} tokens per micro-batch"
        )
    for gpus in gpus_list:
        configured = _configured(plan, gpus)
        fits = fitting(fp, candidates(fp, gpus), gpu_mem * GIB, 1 + RUNNERS_UP)
        if table:
            fit = f"{fits[0][0].describe()} | {fits[0][1].total / GIB:.1f}" if fits else "none fits | -"
            lines.append(f"| {fp.name} | {fp.params / 1e9:.1f} B | {fp.tokens} | {gpus} | {fit} |")
            continue
        lines.append(f"  {gpus} GPUs x {gpu_mem:g} GiB ({usable / GIB:.1f} GiB usable per rank):")
        problem = "needs " + str(configured.gpus) + " GPUs" if configured.gpus != gpus else valid(fp, configured)
        if problem:
            lines.append(f"    configured layout {configured.describe()}: not possible here ({problem})")
        else:
            memory = per_rank(fp, configured)
            verdict = "fits" if memory.total <= usable else "does not fit"
            lines.append(f"    configured: {configured.describe()}\n      {_row(memory)}: {verdict}")
        lines += choice_lines(fits, configured, _row)
    return lines


def argument_errors(gpus: list[int], gpu_mem: float) -> list[str]:
    """Every bad ``--gpus`` / ``--gpu-mem`` value, one line each (a NaN memory fits everything, a trillion devices
    never finishes the layout search)."""
    errors = (
        [f"--gpus: at most {MAX_GPU_COUNTS} device counts, found {len(gpus)}"] if len(gpus) > MAX_GPU_COUNTS else []
    )
    errors += [f"--gpus: {g}: expected a device count in [1, {MAX_GPUS}]" for g in gpus if not 1 <= g <= MAX_GPUS]
    if not (math.isfinite(gpu_mem) and 0 < gpu_mem <= MAX_GPU_MEM):
        errors.append(f"--gpu-mem: {gpu_mem:g}: expected the GiB of one device, a finite number in (0, {MAX_GPU_MEM}]")
    return errors


@contextlib.contextmanager
def _fake_tensor_log_quiet() -> Iterator[None]:
    """Torch logs a failing fake-tensor kernel with its traceback (~30 lines) before raising; the error it raises is
    reported here in one line, so its log would only bury that line."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was


def _say_errors(messages: list[str]) -> None:
    for message in messages:
        print(f"error: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    try:
        rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
        args = _parser().parse_args(rest)
    except (UsageError, OverrideError) as exc:
        _say_errors([f"{exc} (usage: {USAGE}; --help for more)"])
        return USER_ERROR
    errors = argument_errors(args.gpus, args.gpu_mem)
    plans = []
    for path in args.configs:
        try:
            plans.append(read_plan(path, overrides))
        except ConfigError as exc:
            errors.extend(exc.messages)
    if errors:
        _say_errors(errors)
        return USER_ERROR
    if args.table:
        print(
            "| model | parameters | tokens per micro-batch | GPUs | first layout that fits (least recomputation and "
            "communication) | GiB per rank |"
        )
        print("|---|---|---|---|---|---|")
    failed = False
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    for path, plan in zip(args.configs, plans, strict=True):
        try:
            with _fake_tensor_log_quiet():
                lines = _report(plan, args.gpus, args.gpu_mem, args.table, path, progress)
        except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, RuntimeError) as exc:
            # what only building the model finds (e.g. heads that do not divide the hidden size)
            _say_errors([f"{path}: model: {' '.join(str(exc).split())[:300]}"])
            failed = True
            continue
        print("\n".join(lines), flush=True)
    return USER_ERROR if failed else 0


if __name__ == "__main__":
    sys.exit(main())
