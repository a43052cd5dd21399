"""Spec files edited in place for `patchgen upgrade --migrate`: one TOML value of one [[patch]] table changed,
comments and layout kept, and the result checked to parse to exactly the intended values; `origin` finds the file
and table that state a patch (an inherited patch lives in its base spec)."""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from patchgen.spec_extends import prefix_renamer


@dataclass(frozen=True)
class SpecEdit:
    path: Path  # the spec file stating the patch (the base spec for an inherited patch)
    table: int  # its [[patch]] table in that file, 1-based
    key: str  # anchor / before / after / through / scope / vars.<name>
    old: str | None
    new: str


def _patch_count(path: Path) -> int:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    base = _patch_count(path.with_name(f"{data['extends']}.toml")) if "extends" in data else 0
    return base + len(data.get("patch", []))


def origin(path: Path, index: int) -> tuple[Path, int, Callable[[str], str]] | None:
    """The file and [[patch]] table that state patch `index` of the spec at `path`, and the class renaming from that
    file's naming to the spec's (an inherited patch lives in the base spec); None for a patch no file states."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    if "extends" in data:
        base = path.with_name(f"{data['extends']}.toml")
        inherited = _patch_count(base)
        if index <= inherited:
            rename = prefix_renamer(data["class_prefix"], path) if "class_prefix" in data else (lambda t: t)
            found = origin(base, index)
            return None if found is None else (found[0], found[1], lambda t: rename(found[2](t)))
        index -= inherited
    return (path, index, lambda t: t) if index <= len(data.get("patch", [])) else None


_TABLE = re.compile(r"\s*\[")
_PATCH_HEADER = re.compile(r"\s*\[\[\s*patch\s*\]\]\s*(#.*)?$")


def _table_lines(lines: list[str], table: int) -> tuple[int, int]:
    """First and past-the-end line of the `table`-th [[patch]] table (multi-line strings are skipped)."""
    count, start, quote = 0, None, None
    for number, line in enumerate(lines):
        if quote is None and _TABLE.match(line):
            if start is not None:
                return start, number
            if _PATCH_HEADER.match(line):
                count += 1
                start = number if count == table else None
        for mark in ('"""', "'''"):
            if (quote is None or quote == mark) and line.count(mark) % 2:
                quote = None if quote == mark else mark
    if start is None:
        raise ValueError(f"no [[patch]] table number {table}")
    return start, len(lines)


def toml_string(text: str) -> str:
    if '"' in text and "'" not in text and text.isprintable():
        return f"'{text}'"
    return json.dumps(text, ensure_ascii=False)


def _toml_value(value) -> str:
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        keys = [k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k) for k in value]
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in zip(keys, value.values(), strict=True)) + " }"
    raise ValueError(f"cannot write {type(value).__name__} values")


def _string_end(rest: str) -> int:
    """Where the single-line TOML string at the start of `rest` ends."""
    if rest.startswith(("'''", '"""')) or rest[:1] not in ("'", '"'):
        raise ValueError("not a single-line string")
    if rest[0] == "'":
        return rest.index("'", 1) + 1
    at = 1
    while rest[at] != '"':
        at += 2 if rest[at] == "\\" else 1
    return at + 1


def _edit_table(lines: list[str], start: int, end: int, key: str, value: str) -> None:
    if key.startswith("vars."):
        name = key.split(".", 1)[1]
        for number in range(start + 1, end):
            match = re.match(r"(\s*vars\s*=\s*)(.*)$", lines[number])
            if match:
                if "#" in match.group(2):
                    raise ValueError("a vars table with a comment")
                table = tomllib.loads("v = " + match.group(2))["v"]
                lines[number] = match.group(1) + _toml_value({**table, name: value})
                return
        after = max(
            n for n in range(start, end) if re.match(r"\s*(anchor|before|after|through|template)\s*=", lines[n])
        )
        lines.insert(after + 1, f"vars = {_toml_value({name: value})}")
        return
    for number in range(start + 1, end):
        match = re.match(rf"(\s*{key}\s*=\s*)(.*)$", lines[number])
        if match:
            rest = match.group(2)
            lines[number] = match.group(1) + toml_string(value) + rest[_string_end(rest) :]
            return
    raise ValueError(f"no {key!r} key in the table")


def edited_text(text: str, edits: list[SpecEdit]) -> str:
    """The spec text with each edit's value replaced in place; raises ValueError unless the result parses to the
    original table with exactly those values changed."""
    lines = text.splitlines()
    for edit in sorted(edits, key=lambda e: (-e.table, e.key)):  # last table first: inserted lines shift none before
        _edit_table(lines, *_table_lines(lines, edit.table), edit.key, edit.new)
    out = "\n".join(lines) + ("\n" if text.endswith("\n") else "")
    expected = tomllib.loads(text)
    for edit in edits:
        table = expected["patch"][edit.table - 1]
        if edit.key.startswith("vars."):
            table.setdefault("vars", {})[edit.key.split(".", 1)[1]] = edit.new
        else:
            table[edit.key] = edit.new
    if tomllib.loads(out) != expected:
        raise ValueError("the edited file does not parse to the intended values")
    return out
