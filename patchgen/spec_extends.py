"""`extends`: a spec's table with everything it inherits merged in, before the merged table is loaded.

A spec may `extends = "<other spec>"`: it inherits that spec's keep/exclude roots, companions, patches and `[model]`
table, with `class_prefix = { from = "Qwen3VL", to = "Qwen3VLMoe" }` renaming every class name that starts with
`from` (in scopes, anchors, roots and code-valued vars), then appends its own patches, overrides what it names and
drops the inherited `[model]` keys its `remove` list names. Apart from loading (`patchgen.spec`) because the merge
works on raw tables, and `patchgen.spec_edits` renames with the same rule when it edits an inherited patch.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from patchgen.errors import PatchgenError
from patchgen.model import merge_tables
from patchgen.spec_schema import ANCHOR_KEYS, MAX_NAMES, read_toml
from patchgen.templates import load_template
from patchgen.varkinds import is_identifier

MAX_EXTENDS_DEPTH = 4
CODE_KINDS = ("identifier", "dotted", "expr")  # var kinds whose values class_prefix renames
INHERITED_FROM = "__inherited_from__"  # a resolved patch table's (spec file, patch number) where a base states it


def prefix_renamer(rule: Any, path: Path) -> Callable[[str], str]:
    """`{from, to}` -> a function renaming every identifier that starts with `from` inside a code string."""
    if not (
        isinstance(rule, dict)
        and set(rule) == {"from", "to"}
        and all(isinstance(rule[k], str) and is_identifier(rule[k]) for k in rule)
    ):
        raise PatchgenError(
            f'{path}: class_prefix must be {{ from = "<OldPrefix>", to = "<NewPrefix>" }} with identifier values, '
            f"found {rule!r}"
        )
    pattern = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(rule['from'])}(?=[A-Za-z0-9_]*)")
    return lambda text: pattern.sub(rule["to"], text)


def _renamed_patch(patch: dict, rename, templates_dir: Path, path: Path) -> dict:
    """A base spec's patch table with class names renamed in its scope, anchors, removals and code-valued vars."""
    out = dict(patch)
    for key in ("scope", *ANCHOR_KEYS):
        if isinstance(out.get(key), str):
            out[key] = rename(out[key])
    if isinstance(out.get("removes"), list):  # statement starts: upstream code, like the anchors
        out["removes"] = [rename(v) if isinstance(v, str) else v for v in out["removes"]]
    if isinstance(out.get("vars"), dict) and isinstance(out.get("template"), str):
        try:
            template = load_template(templates_dir, out["template"])
        except PatchgenError as exc:
            raise PatchgenError(f"{path}: inherited patch: {exc}") from exc
        variables = {}
        for name, value in out["vars"].items():
            var = template.var(name)
            if var is not None and var.kind.scalar in CODE_KINDS:
                value = (
                    [rename(v) if isinstance(v, str) else v for v in value]
                    if isinstance(value, list)
                    else (rename(value) if isinstance(value, str) else value)
                )
            variables[name] = value
        out["vars"] = variables
    return out


def _inherited(patch: dict, index: int, rename, templates_dir: Path, base_path: Path) -> dict:
    """An inherited patch table, renamed, remembering the file and position that state it (``INHERITED_FROM``: the
    deepest base's), so that an error in it names the file to edit."""
    return {INHERITED_FROM: (base_path, index), **_renamed_patch(patch, rename, templates_dir, base_path)}


def resolve_extends(data: dict, path: Path, templates_dir: Path, depth: int = 0) -> tuple[dict, list[bytes], list]:
    """The spec table with everything it inherits merged in; the raw bytes and paths of the inherited files."""
    if "extends" not in data:
        for key, does in (("class_prefix", "renames"), ("remove", "drops keys of")):
            if key in data:
                raise PatchgenError(f"{path}: {key} {does} what a spec inherits; it needs 'extends'")
        return data, [], []
    name = data["extends"]
    if not isinstance(name, str) or not is_identifier(name):
        raise PatchgenError(
            f"{path}: 'extends' must name another spec in the same folder (a file stem), found {name!r}"
        )
    if depth >= MAX_EXTENDS_DEPTH:
        raise PatchgenError(f"{path}: 'extends' chain deeper than {MAX_EXTENDS_DEPTH} (a cycle?)")
    base_path = path.with_name(f"{name}.toml")
    if base_path.resolve() == path.resolve():
        raise PatchgenError(f"{path}: a spec cannot extend itself")
    if not base_path.is_file():
        raise PatchgenError(f"{path}: 'extends' = {name!r}: no spec file {base_path}")
    base, raw = read_toml(base_path)
    base, raws, paths = resolve_extends(base, base_path, templates_dir, depth + 1)
    rename = prefix_renamer(data["class_prefix"], path) if "class_prefix" in data else (lambda text: text)
    merged = {k: v for k, v in data.items() if k not in ("extends", "class_prefix", "patch", "model", "remove")}
    for key in ("keep", "exclude"):
        if key not in merged and isinstance(base.get(key), list):
            merged[key] = [rename(v) if isinstance(v, str) else v for v in base[key]]
    if "companion" not in merged and isinstance(base.get("companion"), list):
        merged["companion"] = [_renamed_companion(c, rename) for c in base["companion"]]
    inherited = base.get("patch", [])
    if not isinstance(inherited, list):
        raise PatchgenError(f"{base_path}: key 'patch' must be an array of tables")
    own = data.get("patch", [])
    if not isinstance(own, list):
        raise PatchgenError(f"{path}: key 'patch' must be an array of tables")
    merged["patch"] = [
        _inherited(p, i, rename, templates_dir, base_path) if isinstance(p, dict) else p
        for i, p in enumerate(inherited, start=1)
    ] + own
    base_model = base.get("model")
    if isinstance(base_model, dict) or "model" in data:
        renamed = dict(base_model) if isinstance(base_model, dict) else {}
        if isinstance(renamed.get("class"), str):
            renamed["class"] = rename(renamed["class"])
        renamed = _removed(renamed, data, path, base_path)
        merged["model"] = (
            merge_tables(renamed, data.get("model", {})) if isinstance(data.get("model", {}), dict) else data["model"]
        )
    elif "remove" in data:
        _removed({}, data, path, base_path)
    return merged, [raw, *raws], [base_path, *paths]


def _renamed_companion(table: Any, rename) -> Any:
    if not isinstance(table, dict) or not isinstance(table.get("keep"), list):
        return table  # not a companion table: loading the spec says why
    return {**table, "keep": [rename(v) if isinstance(v, str) else v for v in table["keep"]]}


def _removed(model: dict, data: dict, path: Path, base_path: Path) -> dict:
    """The inherited `[model]` table without the keys the spec's `remove` list names (dotted: `model.tiny.x`).
    Each must exist in what is inherited, and the spec must not set it again: a removal that removes nothing, or
    that the spec's own table undoes, is a mistake the reader of the spec would not see."""
    entries = data.get("remove", [])
    if not isinstance(entries, list) or len(entries) > MAX_NAMES:
        raise PatchgenError(
            f"{path}: 'remove' must be an array of at most {MAX_NAMES} dotted keys of the inherited [model] table, "
            f'e.g. remove = ["model.tiny.num_experts"]'
        )
    out = copy.deepcopy(model)
    own = data.get("model", {}) if isinstance(data.get("model"), dict) else {}
    for entry in entries:
        parts = entry.split(".") if isinstance(entry, str) else []
        if len(parts) < 2 or parts[0] != "model" or not all(parts):
            raise PatchgenError(
                f"{path}: 'remove' entry {entry!r}: expected a dotted key of the inherited [model] table, e.g. "
                f'"model.tiny.num_experts"'
            )
        table, mine = out, own
        for part in parts[1:-1]:
            table = table.get(part) if isinstance(table, dict) else None
            mine = mine.get(part, {}) if isinstance(mine, dict) else {}
        if not isinstance(table, dict) or parts[-1] not in table:
            raise PatchgenError(
                f"{path}: 'remove' entry {entry!r}: {base_path.name} (and what it extends) has no such key; remove "
                f"only what is inherited"
            )
        if isinstance(mine, dict) and parts[-1] in mine:
            raise PatchgenError(
                f"{path}: 'remove' entry {entry!r}: this spec sets that key again; either remove it or set it"
            )
        del table[parts[-1]]
    return out
