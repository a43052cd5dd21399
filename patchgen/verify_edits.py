"""The spec edits `patchgen upgrade --migrate --verify` accepts: only what a migration changes.

`--verify` imports and runs the code regenerated from the migrated specs before anyone has reviewed `specs.diff`.
That is safe only because a migration changes nothing but a [[patch]] table's anchor keys, scope and vars: anchors
and scopes select upstream statements of the hash-verified release (they add no code), and every var value is data
validated against its template's kind when the spec loads (an `expr` has no calls: `patchgen.varkinds`). The code
the scratch tree imports therefore comes from the project's own templates and the recorded release. This module
holds `--verify` to that: a migrated text that differs from its spec file in anything else is refused up front.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from patchgen.config import ProjectConfig
from patchgen.errors import PatchgenError

MIGRATED_KEYS = ("anchor", "before", "after", "through", "scope", "vars")


def _difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """The first thing (a top-level key, a patch's key, a patch added or removed) changed outside MIGRATED_KEYS."""
    for key in sorted((set(old) | set(new)) - {"patch"}):
        if old.get(key) != new.get(key):
            return f"key {key!r}"
    old_patches, new_patches = old.get("patch", []), new.get("patch", [])
    if len(old_patches) != len(new_patches):
        return f"patch {min(len(old_patches), len(new_patches)) + 1} (added or removed)"
    for number, (was, now) in enumerate(zip(old_patches, new_patches, strict=True), start=1):
        if not isinstance(was, dict) or not isinstance(now, dict):
            return f"patch {number}" if was != now else None
        for key in sorted((set(was) | set(now)) - set(MIGRATED_KEYS)):
            if was.get(key) != now.get(key):
                return f"patch {number}: key {key!r}"
    return None


def check_spec_edits(config: ProjectConfig, edits: dict[str, str]) -> None:
    """Refuse migrated spec texts (path relative to the project root -> text) that are not an existing spec file's
    text changed only in what a migration changes (MIGRATED_KEYS of its [[patch]] tables)."""
    specs_dir = config.specs_dir.resolve()
    allowed = ", ".join(MIGRATED_KEYS)
    for relpath, text in sorted(edits.items()):
        path = config.root / relpath
        if Path(relpath).is_absolute() or path.suffix != ".toml" or path.resolve().parent != specs_dir:
            raise PatchgenError(f"{relpath}: --verify takes migrated texts of spec files in {specs_dir} only")
        try:
            old = tomllib.loads(path.read_text(encoding="utf-8"))
            new = tomllib.loads(text)
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise PatchgenError(f"{relpath}: cannot compare the migrated spec with its file: {exc}") from exc
        changed = _difference(old, new)
        if changed is not None:
            raise PatchgenError(
                f"{relpath}: the migrated spec changes {changed}; --verify runs code regenerated from migrated specs "
                f"before review only when migration changed nothing but [[patch]] keys {allowed}: review and apply "
                f"the spec change yourself, then run --verify without --migrate"
            )
