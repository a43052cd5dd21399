"""The command line the run entry points share (``python -m runtime.train``, ``runtime.train.prepare``,
``runtime.rl``): ``--help`` and config validation without importing torch, dotted overrides, every config error at
once (printed by rank 0 only), and a launcher like ``accelerate launch``.

``python -m <command> [LAUNCHER OPTIONS] CONFIG.yaml [--section.key=VALUE ...]``: launcher options are torchrun's
(``--nproc-per-node 2``, ``--nnodes``, ``--rdzv-endpoint``, ...). With any of them the config is validated first
(a bad config starts no rank: its errors, exit 2), then torch's own launcher (``torch.distributed.run``) starts the
ranks in this process, and a failed rank becomes one line and its exit code instead of torchrun's
``ChildFailedError`` traceback. Without them the command runs in this process (one process, or one rank of a
``torchrun`` launch).
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime import launcher_options
from runtime.config.common import ParallelConfig
from runtime.config.errors import ConfigError
from runtime.config.layout import fewest_processes, resolve_layout
from runtime.config.overrides import Override, OverrideError, parse_overrides
from runtime.config.yaml_file import ConfigLoader, locate_error, locate_errors
from runtime.launcher_options import LauncherOptionError
from runtime.launcher_signals import LAUNCHER_PID, die_with_launcher, stopped_line

# torchrun's options that take no value (``torch.distributed.run.get_args_parser``; tests/train/test_cli.py checks
# the list against it). Every other launcher option takes one (``--opt VALUE`` or ``--opt=VALUE``).
LAUNCHER_FLAGS = ("--standalone", "--virtual-local-rank", "--virtual_local_rank")
# torchrun options that name what to run: the command sets them itself.
_NOT_LAUNCHER = ("-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path")
_NOT_LAUNCHER_DESTS = frozenset({"module", "no_python", "run_path"})  # theirs, by argparse dest (any spelling)
USER_ERROR = 2  # the exit code of a user error (a bad config, input or launcher option)
RANK_ERROR_GRACE = 5.0  # seconds a rank other than 0 waits before printing a user error (``print_errors``)


class UsageError(ValueError):
    """A command line that does not parse (exit 2, one line)."""


@dataclass(frozen=True)
class Invocation:
    """A parsed command line."""

    config: str | None = None
    overrides: list[Override] = field(default_factory=list)
    override_args: list[str] = field(default_factory=list)  # as typed, handed on to launched ranks
    launcher: list[str] = field(default_factory=list)  # torchrun options, before the config path
    help: bool = False


def parse_command_line(argv: Sequence[str]) -> Invocation:
    """``[LAUNCHER OPTIONS] CONFIG.yaml [--section.key=VALUE ...]``; ``-h``/``--help`` anywhere asks for help.
    Launcher options are read as torchrun reads them (``runtime/launcher_options.py``: abbreviations, ``=VALUE``,
    ``-r0``), so an abbreviation of an option the command sets itself is refused like the option."""
    argv = list(argv)
    if any(arg in ("-h", "--help") for arg in argv):
        return Invocation(help=True)
    launcher: list[str] = []
    while argv and argv[0].startswith("-"):
        option = argv.pop(0)
        try:
            dest, _ = launcher_options.match(option)
            if dest == "help":
                return Invocation(help=True)
            if dest in _NOT_LAUNCHER_DESTS:
                exact = option.partition("=")[0] in _NOT_LAUNCHER
                read = "" if exact else f" torchrun reads it as {launcher_options.spelling(dest)}:"
                raise UsageError(f"{option}:{read} the command sets what the ranks run; give only launcher options")
            dest, value = launcher_options.resolve(option)
        except LauncherOptionError as exc:
            raise UsageError(str(exc)) from None
        launcher.append(option)
        if dest not in launcher_options.TORCHRUN_FLAGS and value is None:
            if not argv:
                raise UsageError(f"{option}: expected a value")
            value = argv.pop(0)
            launcher.append(value)
        try:
            launcher_options.check_value(dest, value)
        except LauncherOptionError as exc:
            raise UsageError(str(exc)) from None
    if not argv:
        raise UsageError("expected a config file")
    config, rest = argv[0], argv[1:]
    try:
        overrides = parse_overrides(rest, ConfigLoader)
    except OverrideError as exc:
        raise UsageError(str(exc)) from None
    return Invocation(config, overrides, rest, launcher)


def docstring(module: str) -> str:
    """A module's docstring read from its source (nothing is imported: no torch for ``--help``)."""
    origin = importlib.util.find_spec(module).origin
    return ast.get_docstring(ast.parse(Path(origin).read_text(encoding="utf-8"))) or ""


def help_text(command: str, about: str, references: Sequence[tuple[str, str]]) -> str:
    """``--help``: usage, what the command does, the command line, then each ``(title, module)``'s docstring."""
    parts = [
        f"usage: python -m {command} [LAUNCHER OPTIONS] CONFIG.yaml [--section.key=VALUE ...]",
        f"       torchrun --nproc-per-node N -m {command} CONFIG.yaml [--section.key=VALUE ...]",
        "",
        about.strip(),
        "",
        "  CONFIG.yaml           the run configuration (YAML; the reference is below)",
        "  --section.key=VALUE   set one key over the file's value (also --section.key VALUE); VALUE is read as YAML",
        "                        and checked like the file's: --train.steps=3 --optim.lr=1e-4",
        "                        --log.report_to=[tensorboard]",
        "  LAUNCHER OPTIONS      torchrun's, before CONFIG.yaml (--nproc-per-node N, --nnodes, --node-rank,",
        "                        --rdzv-endpoint, ...): the config is validated first (a bad one starts no rank),",
        "                        then the ranks are started here (torch.distributed.run) and a failed rank is",
        "                        reported in one line with its exit code",
        "  -h, --help            this text",
        "",
        "Exit code 0: done; 2: a user error (each one line: file:line: key: what is wrong; under several ranks",
        "rank 0 prints it); 143 / 130: the launcher was stopped by SIGTERM / SIGINT (and stopped the ranks);",
        "another code: that of a rank that failed otherwise.",
    ]
    for title, module in references:
        parts += ["", f"== {title} ({module.replace('.', '/')}.py) ==", "", docstring(module)]
    return "\n".join(parts)


def is_rank_zero() -> bool:
    """Rank 0 of a launch (or no launch): the one rank that prints user errors."""
    return os.environ.get("RANK", "0") == "0"


def print_errors(exc: ConfigError) -> None:
    """Each message of ``exc`` as one ``error:`` line on stderr, said once per launch: every rank finds the same
    errors in the same files, and rank 0 prints them. Under torchrun another rank waits ``RANK_ERROR_GRACE`` seconds
    first: when rank 0 failed too, torchrun stops this rank in that time and the error is said once; a rank still
    running then found an error of its own, and prints it."""
    if not is_rank_zero():
        if not under_torchrun():
            return
        time.sleep(RANK_ERROR_GRACE)
    for message in exc.messages or [str(exc)]:
        print(f"error: {message}", file=sys.stderr, flush=True)


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + signal number


def _failure_line(rank: int, code: int, others: int) -> str | None:
    """One line for the rank whose failure ended a launch, None when it exited with a user error that it has printed
    (rank 0 prints user errors; every rank finds them). ``others``: ranks the launcher stopped after it."""
    if code == USER_ERROR and rank == 0:
        return None
    if code < 0:
        try:
            what = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            what = f"was killed by signal {-code}"
    else:
        what = f"exited with code {code}"
    stopped = f"; the launcher stopped the other {others} rank(s)" if others else ""
    return f"error: rank {rank} {what} (its output is above){stopped}"


def launch(module: str, launcher: Sequence[str], script_args: Sequence[str]) -> int:
    """Start ``python -m module *script_args`` on the ranks that torchrun's ``launcher`` options describe, with torch's
    launcher (``torch.distributed.run``), in this process; the first failed rank's exit code, 0 when all finished."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = torchrun.get_args_parser()

    def refuse(message: str) -> None:
        raise UsageError(f"launcher options: {message}")

    parser.error = refuse  # one line instead of argparse's usage text
    args = parser.parse_args([*launcher, "-m", module, *script_args])
    if args.run_path or args.no_python or args.training_script != module:  # parse_command_line refused these already
        refuse(f"{' '.join(launcher)}: the command sets what the ranks run; give only launcher options")
    # The agent's own log of a failure (each rank's exit code, the SIGTERMs it sends the others) is said by the one
    # line below; its warnings at start (OMP_NUM_THREADS) still show.
    # (each elastic module's logger has a level of its own: the agent's says "Received 15 death signal" itself)
    for name in ("torch.distributed.elastic", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    before = os.environ.get(LAUNCHER_PID)
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the ranks die with this process (runtime/launcher_signals.py)
    try:
        torchrun.run(args)
    except SignalException as exc:  # the agent passed it on to the ranks and stopped them
        print(stopped_line(exc.sigval), file=sys.stderr, flush=True)
        return 128 + exc.sigval
    except KeyboardInterrupt:  # before the agent's handlers were installed
        print(stopped_line(signal.SIGINT), file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    except ChildFailedError as exc:
        # The agent stops the other ranks with SIGTERM once one fails (failure times are whole seconds): the failed
        # rank is the lowest one that did not exit by that signal.
        own = sorted(r for r, f in exc.failures.items() if f.exitcode != -signal.SIGTERM)
        rank, failure = (own[0], exc.failures[own[0]]) if own else exc.get_first_failure()
        line = _failure_line(rank, failure.exitcode, len(exc.failures) - 1)
        if line:
            print(line, file=sys.stderr, flush=True)
        return _exit_code(failure.exitcode) or 1
    finally:
        if before is None:
            os.environ.pop(LAUNCHER_PID, None)
        else:
            os.environ[LAUNCHER_PID] = before
    return 0


def launched_processes(launcher: Sequence[str]) -> int | None:
    """How many processes torchrun's ``launcher`` options start: ``--nproc-per-node`` x ``--nnodes``; None when a
    count is left to torchrun (``--nproc-per-node gpu``, an elastic ``--nnodes 1:4``)."""
    values = {"nproc_per_node": "1", "nnodes": "1"}  # torchrun's defaults
    tokens = list(launcher)
    while tokens:
        dest, value = launcher_options.resolve(tokens.pop(0))
        if dest not in launcher_options.TORCHRUN_FLAGS and value is None and tokens:
            value = tokens.pop(0)
        if dest in values and value is not None:
            values[dest] = value
    if not all(v.isdigit() for v in values.values()):
        return None
    return int(values["nproc_per_node"]) * int(values["nnodes"])


def check_layout_fits(layout: ParallelConfig | None, command: str, invocation: Invocation) -> None:
    """The config's ``parallel`` layout must tile the processes the command starts, checked before any rank starts
    (and before torch is imported): one process without launcher options, or what the launcher options say. A
    ``ConfigError`` naming ``parallel`` and the command line that would run it otherwise."""
    if layout is None or (not invocation.launcher and under_torchrun()):
        return  # under torchrun the ranks check it against the world they are in
    world = launched_processes(invocation.launcher) if invocation.launcher else 1
    if world is None:
        return
    sizes = (layout.dp_replicate, layout.dp_shard, layout.sp, layout.ep)
    try:
        resolve_layout(world, layout.dp_replicate, layout.dp_shard, layout.sp, layout.ep, layout.ring)
        return
    except ValueError:
        pass
    need = fewest_processes(*sizes)
    shard = layout.dp_shard or "auto"
    shown = f"dp_replicate {layout.dp_replicate} x dp_shard {shard} x sp {layout.sp} (ep {layout.ep})"
    run = " ".join([f"python -m {command} --nproc-per-node {need}", invocation.config, *invocation.override_args])
    if not invocation.launcher:
        raise ConfigError(f"parallel: {shown} needs {need} processes and this command runs one; launch them: {run}")
    raise ConfigError(
        f"parallel: {shown} does not tile the {world} processes the launcher options start (--nproc-per-node x "
        f"--nnodes); {need} would: {run}"
    )


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def run_command(
    argv: Sequence[str] | None,
    *,
    command: str,
    about: str,
    references: Sequence[tuple[str, str]],
    load: Callable[[str, Sequence[Override]], Any],
    run: Callable[[Any], None],
    locate: Callable[[str, Path], str] = locate_error,
    before_launch: Callable[[Any], None] | None = None,
) -> int:
    """The whole command line of an entry point: help, parse, load (no torch), then launch or ``run`` the config.
    ``load`` and ``run`` raise ``ConfigError`` for user errors, whose every message is printed (rank 0) with exit
    code 2; an error ``run`` finds (while setting up, or a guard that stops the run) is named by where its key was
    set (``locate`` finds a key's line in the config file). With launcher options, ``before_launch`` runs the checks
    that need no rank first, in this process (its errors once, in seconds). The process groups ``run`` made are
    always freed."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        invocation = parse_command_line(argv)
    except UsageError as exc:
        if is_rank_zero():
            print(
                f"error: {exc} (usage: python -m {command} [LAUNCHER OPTIONS] CONFIG.yaml [--section.key=VALUE "
                f"...]; --help for the config reference)",
                file=sys.stderr,
                flush=True,
            )
        return USER_ERROR
    if invocation.help:
        try:
            print(help_text(command, about, references), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    try:
        config = load(invocation.config, invocation.overrides)  # its errors name their file and line already
    except ConfigError as exc:
        print_errors(exc)
        return USER_ERROR
    try:
        check_layout_fits(getattr(config, "parallel", None), command, invocation)
    except ConfigError as exc:
        print_errors(locate_errors(exc, Path(invocation.config), invocation.overrides, locate))
        return USER_ERROR
    if invocation.launcher:
        if under_torchrun():
            print(
                f"error: launcher options ({invocation.launcher[0]}) under torchrun: give them to torchrun or to "
                f"python -m {command}, not both",
                file=sys.stderr,
                flush=True,
            )
            return USER_ERROR
        if before_launch is not None:
            try:
                before_launch(config)
            except ConfigError as exc:
                print_errors(locate_errors(exc, Path(invocation.config), invocation.overrides, locate))
                return USER_ERROR
        try:
            return launch(command, invocation.launcher, [invocation.config, *invocation.override_args])
        except UsageError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return USER_ERROR
    die_with_launcher()  # a rank this command's launcher started ends with it (SIGKILLed, or passing on SIGINT)
    from runtime.torch_compat import require_supported_torch  # imports torch: only where a rank runs the job

    try:
        require_supported_torch()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return USER_ERROR
    failure: BaseException | None = None
    try:
        run(config)
    except ConfigError as exc:
        failure = exc
        print_errors(locate_errors(exc, Path(invocation.config), invocation.overrides, locate))
        return USER_ERROR
    except BaseException as exc:
        failure = exc
        raise
    finally:
        _teardown(failure)
    return 0


def _teardown(failure: BaseException | None) -> None:
    """Free the process groups and their threads before exit (``runtime.parallel.teardown``: why)."""
    if "torch.distributed" in sys.modules:  # nothing to tear down when the run never imported torch
        from runtime.parallel.teardown import shutdown

        shutdown(failure=failure)
