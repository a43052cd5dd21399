"""Per-model patch specs: TOML data -> frozen dataclasses, validated against the templates they name.

Loading a spec parses TOML and reads template front matter; it never executes code from either.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from patchgen.errors import PatchgenError
from patchgen.templates import Template, load_template

SPEC_KEYS = {"module": str, "output": str, "keep": list, "exclude": list, "patch": list}
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
}
REQUIRED_PATCH_KEYS = ("template", "scope", "why")


@dataclass(frozen=True)
class Patch:
    index: int  # 1-based position in the spec, as users count
    template: Template
    scope: str
    why: str
    vars: dict[str, Any] = field(hash=False)
    before: str | None = None
    after: str | None = None
    anchor: str | None = None
    through: str | None = None  # op replace: last statement of the replaced run

    @property
    def label(self) -> str:
        return f"patch {self.index} ({self.template.name})"

    @property
    def anchor_text(self) -> str | None:
        return self.before or self.after or self.anchor


@dataclass(frozen=True)
class Spec:
    name: str
    path: Path
    module: str
    output: str
    keep: tuple[str, ...]
    exclude: tuple[str, ...]
    patches: tuple[Patch, ...]
    sha256: str

    @property
    def package(self) -> str:
        """The upstream distribution the module comes from (its top-level package)."""
        return self.module.split(".")[0]


def _type_name(value: Any) -> str:
    return {str: "string", int: "integer", float: "float", bool: "boolean", list: "array", dict: "table"}.get(
        type(value), type(value).__name__
    )


def _a(noun: str) -> str:
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


def _check_keys(table: dict, allowed: dict, required: tuple, path: Path, where: str) -> None:
    where = where or "top level"
    for key in required:
        if key not in table:
            raise PatchgenError(f"{path}: {where}: missing required key {key!r} ({_type_name(allowed[key]())})")
    for key, value in table.items():
        if key not in allowed:
            raise PatchgenError(f"{path}: {where}: unknown key {key!r}; expected one of {sorted(allowed)}")
        if not isinstance(value, allowed[key]) or isinstance(value, bool) and allowed[key] is not bool:
            raise PatchgenError(
                f"{path}: {where}: key {key!r} must be {_a(_type_name(allowed[key]()))}, "
                f"found {_type_name(value)} {value!r}"
            )


def _str_list(value: list, path: Path, key: str) -> tuple[str, ...]:
    if not all(isinstance(v, str) and v for v in value):
        raise PatchgenError(f"{path}: key {key!r} must be an array of non-empty strings, found {value!r}")
    return tuple(value)


def _load_patch(index: int, table: Any, path: Path, templates_dir: Path) -> Patch:
    where = f"patch {index}"
    if not isinstance(table, dict):
        raise PatchgenError(f"{path}: {where}: must be a table ([[patch]]), found {_type_name(table)}")
    if isinstance(table.get("template"), str):
        where = f"patch {index} ({table['template']})"
    _check_keys(table, PATCH_KEYS, REQUIRED_PATCH_KEYS, path, where)
    try:
        template = load_template(templates_dir, table["template"])
    except PatchgenError as exc:
        raise PatchgenError(f"{path}: {where}: {exc}") from exc
    given = [k for k in ("before", "after", "anchor") if k in table]
    _check_anchor_keys(template.op, given, path, where)
    if "through" in table and template.op != "replace":
        raise PatchgenError(
            f"{path}: {where}: 'through' (end of a replaced run of statements) needs op 'replace', "
            f"template {template.name} has op {template.op!r}"
        )
    values = dict(table.get("vars", {}))
    for name, value in values.items():
        var = template.var(name)
        if var is None:
            declared = ", ".join(v.name for v in template.vars) or "none"
            raise PatchgenError(
                f"{path}: {where}: vars.{name} is not declared by template {template.name} (declared: {declared})"
            )
        if not var.accepts(value):
            raise PatchgenError(
                f"{path}: {where}: vars.{name} must be {var.type}, found {_type_name(value)} {value!r}"
            )
    missing = [v.name for v in template.vars if v.required and v.name not in values]
    if missing:
        docs = "; ".join(f"{v.name} ({v.type}): {v.doc}" for v in template.vars if v.name in missing)
        raise PatchgenError(f"{path}: {where}: template {template.name} needs vars {missing}: {docs}")
    if not table["why"].strip():
        raise PatchgenError(f"{path}: {where}: 'why' must say in one line why the patch exists")
    return Patch(
        index,
        template,
        table["scope"],
        table["why"].strip(),
        values,
        table.get("before"),
        table.get("after"),
        table.get("anchor"),
        table.get("through"),
    )


def _check_anchor_keys(op: str, given: list[str], path: Path, where: str) -> None:
    expected = {
        "insert": ("exactly one of 'before' or 'after'", lambda g: g in (["before"], ["after"])),
        "replace": ("'anchor' (the statement to replace)", lambda g: g == ["anchor"]),
        "wrap": ("'anchor' (the expression to wrap)", lambda g: g == ["anchor"]),
        "add_definition": ("at most one of 'before' or 'after'", lambda g: g in ([], ["before"], ["after"])),
    }.get(op, ("no anchor key: the scope names the target", lambda g: g == []))
    if not expected[1](given):
        raise PatchgenError(f"{path}: {where}: op {op!r} takes {expected[0]}; found {given or 'none'}")


def load_spec(path: Path, templates_dir: Path) -> Spec:
    if not path.is_file():
        raise PatchgenError(f"{path}: spec file not found")
    raw = path.read_bytes()
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise PatchgenError(f"{path}: not valid TOML: {exc}") from exc
    _check_keys(data, SPEC_KEYS, REQUIRED_SPEC_KEYS, path, "")
    keep = _str_list(data["keep"], path, "keep")
    if not keep:
        raise PatchgenError(f"{path}: key 'keep' must name at least one root definition to keep")
    if not data["module"].replace(".", "").replace("_", "").isalnum():
        raise PatchgenError(f"{path}: key 'module' must be a dotted module name, found {data['module']!r}")
    if not data["output"].endswith(".py") or Path(data["output"]).is_absolute():
        raise PatchgenError(f"{path}: key 'output' must be a relative path ending in .py, found {data['output']!r}")
    patches = tuple(_load_patch(i, t, path, templates_dir) for i, t in enumerate(data.get("patch", []), start=1))
    return Spec(
        path.stem,
        path,
        data["module"],
        data["output"],
        keep,
        _str_list(data.get("exclude", []), path, "exclude"),
        patches,
        hashlib.sha256(raw).hexdigest(),
    )
