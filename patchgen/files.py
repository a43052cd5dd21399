"""Atomic, all-or-nothing writes of generated outputs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

PACKAGE_INIT = "# Package of generated modeling files; written by `patchgen regen`.\n"


def write_atomic(files: dict[Path, str]) -> None:
    """Stage every file as a temp file beside its target, then rename each into place.

    A failure while staging leaves every target untouched; a crash between renames leaves each file
    either old or new, never partial.
    """
    staged: list[tuple[Path, Path]] = []
    try:
        for path, text in sorted(files.items()):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            staged.append((Path(tmp), path))
        for tmp, path in staged:
            os.replace(tmp, path)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)


def package_inits(generated_dir: Path, target: Path) -> dict[Path, str]:
    """The `__init__.py` files that make a generated module importable as a package member: one in every
    directory from the generated directory down to the module's, never above it (that is the user's code)."""
    inits = {}
    parent = target.parent
    while parent.is_relative_to(generated_dir):
        inits[parent / "__init__.py"] = PACKAGE_INIT
        if parent == generated_dir:
            break
        parent = parent.parent
    return inits
