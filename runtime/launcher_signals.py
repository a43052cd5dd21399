"""The lifetime of the ranks a run command launches (``python -m runtime.train --nproc-per-node 2 ...``): they end
with the launcher, and a launcher stopped by a signal says so in one line with the shell's exit code.

torchrun's agent runs in the launcher's process and passes SIGTERM/SIGINT/SIGHUP/SIGQUIT on to the ranks, but a
SIGKILL (an out-of-memory kill, a scheduler's hard stop) it cannot pass on: the ranks, in sessions of their own,
would train and checkpoint on without it. So the launcher names itself to its ranks (``LAUNCHER_PID``), and each
rank arms Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``), or elsewhere a thread watching its
parent's pid, before it starts. A checkpoint cut short by that kill has no completion marker and is never resumed.
A SIGINT the agent passes on ends a rank at once and quietly (no ``KeyboardInterrupt`` traceback per rank); the
launcher, stopped by SIGTERM or SIGINT, says so in one line and exits with 143 or 130 (``stopped_line``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["LAUNCHER_PID", "die_with_launcher", "stopped_line"]

LAUNCHER_PID = "RUNTIME_LAUNCHER_PID"  # set by the launcher for the ranks it starts
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_WATCH_PERIOD = 1.0  # seconds between two looks at the parent's pid, where prctl is not there


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _watch(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(_WATCH_PERIOD)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm() -> bool:
    """Linux's parent-death signal for this process: SIGKILL when the thread that started it ends."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_launcher() -> None:
    """Arm this rank to die with the launcher that started it (``LAUNCHER_PID``, when it is this process's parent),
    and to leave quietly when the launcher passes a SIGINT on. Nothing for a rank another launcher started
    (``torchrun`` itself: its own agent's business)."""
    value = os.environ.get(LAUNCHER_PID, "")
    if not value.isdigit():
        return
    launcher = int(value)
    if os.getppid() != launcher:
        if _gone(launcher):  # it died before this rank got here
            os.kill(os.getpid(), signal.SIGKILL)
        return  # a process the launcher's rank started in turn: not the launcher's child
    armed = _arm()
    if os.getppid() != launcher:  # it died between the look and the arming: nothing will deliver the signal now
        os.kill(os.getpid(), signal.SIGKILL)
    if not armed:
        threading.Thread(target=_watch, args=(launcher,), name="launcher-watch", daemon=True).start()
    signal.signal(signal.SIGINT, _leave)


def _leave(signum: int, frame: object) -> None:
    """SIGINT in a launched rank: its launcher passed it on, and says why, once. So this rank leaves at once and
    quietly, not with a ``KeyboardInterrupt`` traceback from wherever it was; and without an orderly exit, since a
    collective may be in flight and an interpreter that finalizes under one can abort (runtime/parallel/teardown.py).
    Checkpoints are written atomically: one cut short is never resumed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(128 + signum)


def stopped_line(signum: int) -> str:
    """The one line a launcher stopped by signal ``signum`` says (its exit code is the shell's 128 + signum)."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return (
        f"stopped: the launcher got {name} and stopped the ranks; the checkpoints written so far are intact "
        f"(checkpoint.resume: auto continues from the newest)"
    )
