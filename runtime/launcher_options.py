"""torchrun's options as its parser reads them, without importing torch: the launcher options of the run commands
(``python -m runtime.train --nproc-per-node 2 cfg.yaml``) are read here first, so that the command line and the
config are checked before torch is imported.

torchrun parses with argparse, which takes any unambiguous prefix of a long option (``--nproc-per`` is
``--nproc-per-node``; ``--run-pat x`` is ``--run-path``: it would run the file ``x`` instead of the trainer) and a
short option with its value attached (``-r0``). ``resolve`` reproduces that matching over torchrun's option list
(``TORCHRUN_OPTIONS``; tests/hostile/test_launch_round4.py checks the list and the matching against
``torch.distributed.run.get_args_parser``), so an abbreviation of an option the command refuses is refused too, and an
option's value is found where torchrun finds it.
"""

from __future__ import annotations

import re

__all__ = ["TORCHRUN_FLAGS", "TORCHRUN_OPTIONS", "LauncherOptionError", "check_value", "match", "resolve", "spelling"]


def _spellings(names: str, short: dict[str, str]) -> dict[str, str]:
    """option string -> dest for torchrun's dashed option names (each with its underscore spelling, when it has a
    dash, and its short form)."""
    out: dict[str, str] = {}
    for name in names.split():
        dest = name.replace("-", "_")
        if name in short:
            out[short[name]] = dest
        out[f"--{name}"] = dest
        if "-" in name:
            out[f"--{dest}"] = dest
    return out


# torch.distributed.run.get_args_parser() of torch 2.13, in its order: option string -> dest.
TORCHRUN_OPTIONS: dict[str, str] = _spellings(
    "help nnodes nproc-per-node rdzv-backend rdzv-endpoint rdzv-id rdzv-conf standalone max-restarts "
    "monitor-interval start-method event-log-handler role module no-python run-path log-dir redirects tee "
    "local-ranks-filter duplicate-stdout-filters duplicate-stderr-filters node-rank master-addr master-port "
    "local-addr logs-specs numa-binding signals-to-handle shutdown-timeout virtual-local-rank",
    {"help": "-h", "module": "-m", "redirects": "-r", "tee": "-t"},
)
TORCHRUN_FLAGS = frozenset({"help", "standalone", "module", "no_python", "run_path", "virtual_local_rank"})  # no value
_DEVICES = ("auto", "cpu", "gpu", "xpu")  # torchrun's nproc-per-node names besides a number
_DEVICE_NAME = re.compile(r"[a-z][a-z0-9_]*")  # or a PrivateUse1 backend's (npu, ...), which only torch knows


class LauncherOptionError(ValueError):
    """A launcher option torchrun would not take, or would read other than the command means; one line."""


def match(token: str) -> tuple[str, str | None]:
    """``(dest, value given in the token or None)`` of the launcher option ``token`` as torchrun's argparse matches
    it: an exact option string, ``--opt=VALUE``, an unambiguous prefix of a long option (with or without
    ``=VALUE``), or a short option with its value attached (``-r0``). ``LauncherOptionError`` for an unknown or
    ambiguous option. A value given to an option that takes none is returned too (``resolve`` refuses it)."""
    name, eq, value = token.partition("=")
    if token in TORCHRUN_OPTIONS:
        return TORCHRUN_OPTIONS[token], None
    if name in TORCHRUN_OPTIONS:
        return TORCHRUN_OPTIONS[name], value
    if token.startswith("--"):
        matches = [option for option in TORCHRUN_OPTIONS if option.startswith(name)]
        if len(matches) > 1:
            raise LauncherOptionError(f"{token}: ambiguous launcher option: it could be {', '.join(matches)}")
        if matches:
            return TORCHRUN_OPTIONS[matches[0]], value if eq else None
    elif len(token) > 2 and token[:2] in TORCHRUN_OPTIONS:  # argparse: -r0 is -r with the value 0
        return TORCHRUN_OPTIONS[token[:2]], token[2:]
    raise LauncherOptionError(f"{token}: not a launcher option (torchrun's; --help lists the usual ones)")


def resolve(token: str) -> tuple[str, str | None]:
    """``match``, and a ``LauncherOptionError`` for a value given to an option that takes none (as argparse)."""
    dest, value = match(token)
    if value is not None and dest in TORCHRUN_FLAGS:
        raise LauncherOptionError(f"{token}: {spelling(dest)} takes no value")
    return dest, value


def spelling(dest: str) -> str:
    """The option string a user reads for ``dest`` (``nproc_per_node`` -> ``--nproc-per-node``)."""
    return next(option for option, d in TORCHRUN_OPTIONS.items() if d == dest and option.startswith("--"))


_NNODES = re.compile(r"(\d+)(?::(\d+))?")


def check_value(dest: str, value: str | None) -> None:
    """``LauncherOptionError`` for a value of ``--nproc-per-node`` or ``--nnodes`` torchrun cannot start (it would
    stop with a traceback, or start nothing). A device name other than torchrun's own is left to torchrun."""
    if dest == "nproc_per_node":
        if value is not None and (value.isdigit() and int(value) >= 1 or _DEVICE_NAME.fullmatch(value)):
            return
        raise LauncherOptionError(
            f"--nproc-per-node {value}: expected a number of processes per node of at least 1, or one of "
            f"{', '.join(_DEVICES)}"
        )
    if dest == "nnodes":
        match = _NNODES.fullmatch(value)
        low, high = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
        if not 1 <= low <= high:
            raise LauncherOptionError(
                f"--nnodes {value}: expected a number of nodes of at least 1, or MIN:MAX with 1 <= MIN <= MAX"
            )
