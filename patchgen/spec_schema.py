"""What a spec file may hold, and reading it: the keys of each table with their types, the limits, the TOML read.

Apart from loading (`patchgen.spec`) because the spec a file `extends` (`patchgen.spec_extends`) and the raw outputs
the project checks before loading anything (`patchgen.spec_set`) are read and checked by the same rules.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from patchgen.errors import PatchgenError
from patchgen.varkinds import is_identifier, type_name

SPEC_KEYS = {
    "module": str,
    "output": str,
    "keep": list,
    "exclude": list,
    "patch": list,
    "extends": str,
    "class_prefix": dict,
    "model": dict,
    "companion": list,
    "remove": list,
}
COMPANION_KEYS = {"module": str, "keep": list}
REQUIRED_SPEC_KEYS = ("module", "output", "keep")
PATCH_KEYS = {
    "template": str,
    "scope": str,
    "before": str,
    "after": str,
    "anchor": str,
    "through": str,
    "vars": dict,
    "why": str,
    "removes": list,
}
REQUIRED_PATCH_KEYS = ("template", "scope", "why")
ANCHOR_KEYS = ("before", "after", "anchor", "through")
# Limits that make hostile or runaway input fail fast and clearly instead of exhausting memory or time.
MAX_SPEC_BYTES = 1 << 20  # a spec file, and each one it extends
MAX_PATCHES = 256
MAX_NAMES = 256  # entries of `keep` and of `exclude`
MAX_WHY_CHARS = 300  # a `why` is one line of a comment
MAX_COMPANIONS = 16  # [[companion]] modules of one spec


def _a(noun: str) -> str:
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


def check_keys(table: dict, allowed: dict, required: tuple, path: Path, where: str) -> None:
    """Every required key present, no unknown key, each value of its declared type: one message per mistake."""
    where = where or "top level"
    for key in required:
        if key not in table:
            raise PatchgenError(f"{path}: {where}: missing required key {key!r} ({type_name(allowed[key]())})")
    for key, value in table.items():
        if key not in allowed:
            raise PatchgenError(f"{path}: {where}: unknown key {key!r}; expected one of {sorted(allowed)}")
        if not isinstance(value, allowed[key]) or isinstance(value, bool) and allowed[key] is not bool:
            raise PatchgenError(
                f"{path}: {where}: key {key!r} must be {_a(type_name(allowed[key]()))}, "
                f"found {type_name(value)} {value!r}"
            )


def names(value: list, path: Path, key: str) -> tuple[str, ...]:
    """A `keep` or `exclude` list: at most MAX_NAMES top-level definition names."""
    if len(value) > MAX_NAMES:
        raise PatchgenError(f"{path}: key {key!r} has {len(value)} names; at most {MAX_NAMES}")
    if not all(isinstance(v, str) and is_identifier(v) for v in value):
        raise PatchgenError(
            f"{path}: key {key!r} must be an array of top-level definition names, found {_short(value)}"
        )
    return tuple(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def read_toml(path: Path) -> tuple[dict, bytes]:
    """A spec file's table and bytes; never more than MAX_SPEC_BYTES are read."""
    if not path.is_file():
        raise PatchgenError(f"{path}: spec file not found")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_SPEC_BYTES + 1)
        if len(raw) > MAX_SPEC_BYTES:
            raise PatchgenError(f"{path}: larger than {MAX_SPEC_BYTES // 1024} KiB; a spec is a short list of patches")
        return tomllib.loads(raw.decode("utf-8")), raw
    except UnicodeDecodeError as exc:
        raise PatchgenError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise PatchgenError(f"{path}: not valid TOML: {exc}") from exc
    except RecursionError:
        raise PatchgenError(f"{path}: not valid TOML: arrays or tables nested too deeply") from None
    except OSError as exc:
        raise PatchgenError(f"{path}: cannot read the spec: {exc.strerror}") from exc
