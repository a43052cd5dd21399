"""Where checkpoints are: ``root/step_<n>`` directories carrying the ``COMPLETE`` marker (the only name a finished save
ever has), newest by step. Kept apart from saving and verifying so both can name what a directory holds."""

from __future__ import annotations

import re
from pathlib import Path

COMPLETE_MARKER = "COMPLETE"

_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir_name(step: int) -> str:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return f"step_{step:06d}"


def checkpoint_step(path: Path) -> int:
    match = _STEP_DIR.match(Path(path).name)
    if match is None:
        raise ValueError(f"not a checkpoint directory name (step_<n>): {path}")
    return int(match.group(1))


def is_complete_checkpoint(path: Path) -> bool:
    path = Path(path)
    return _STEP_DIR.match(path.name) is not None and (path / COMPLETE_MARKER).is_file()


def list_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete_checkpoint(p)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root``; None if there is none."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def describe_checkpoints(root: Path, limit: int = 8) -> str:
    """What ``root`` holds, for a message about a checkpoint that is not there: ``checkpoints in R: a, b`` (the
    newest ``limit``) or ``no checkpoints in R``."""
    found = [p.name for p in list_checkpoints(root)]
    if not found:
        return f"no checkpoints in {root}"
    shown = found[-limit:]
    more = f" (and {len(found) - limit} older)" if len(found) > limit else ""
    return f"checkpoints in {root}: {', '.join(shown)}{more}"
