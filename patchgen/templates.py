"""Patch kinds: one jinja2 file each, with a TOML front matter declaring its operation, variables and imports.

A template file looks like::

    {#
    op = "wrap"
    doc = "Keep this SP rank's slice of the RoPE table computed from global position ids."
    imports = ["from runtime.sp.positions import slice_position_embeddings"]
    [vars.seq_dim]
    type = "int"
    default = 1
    doc = "sequence dimension of cos/sin"
    #}
    slice_position_embeddings({{ expr }}, seq_dim={{ seq_dim }})

The front matter is data (TOML); the body is rendered with StrictUndefined so a missing variable is an error,
never an empty string in generated code.
"""

from __future__ import annotations

import functools
import hashlib
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from patchgen.errors import PatchgenError

# op -> the anchor keys a spec patch must (exactly one of) or may give, and the builtin variables it gets.
OPS: dict[str, dict[str, Any]] = {
    "insert": {"anchors": ("before", "after"), "builtins": ()},
    "replace": {"anchors": ("anchor",), "builtins": ()},
    "wrap": {"anchors": ("anchor",), "builtins": ("expr",)},
    "add_method": {"anchors": (), "builtins": ()},
    "replace_method": {"anchors": (), "builtins": ()},
    "add_definition": {"anchors": ("before", "after", None), "builtins": ()},
    "replace_definition": {"anchors": (), "builtins": ()},
    "rename": {"anchors": (), "builtins": ()},
}
BUILTIN_VARS = ("expr", "scope")
VAR_TYPES: dict[str, Any] = {
    "str": str,
    "int": int,
    "float": (int, float),
    "bool": bool,
    "list[str]": (list, str),
    "list[int]": (list, int),
}
_MISSING = object()


@dataclass(frozen=True)
class TemplateVar:
    name: str
    type: str
    doc: str
    default: Any = _MISSING

    @property
    def required(self) -> bool:
        return self.default is _MISSING

    def accepts(self, value: Any) -> bool:
        kind = VAR_TYPES[self.type]
        if isinstance(kind, tuple) and kind[0] is list:
            return isinstance(value, list) and all(_is(item, kind[1]) for item in value)
        return _is(value, kind)


def _is(value: Any, kind: Any) -> bool:
    if isinstance(value, bool) and kind is not bool and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        return False  # TOML true is not an int
    return isinstance(value, kind)


@dataclass(frozen=True)
class Template:
    name: str
    path: Path
    op: str
    doc: str
    vars: tuple[TemplateVar, ...]
    imports: tuple[str, ...]
    body: str
    sha256: str

    def var(self, name: str) -> TemplateVar | None:
        return next((v for v in self.vars if v.name == name), None)

    def render(self, values: dict[str, Any]) -> str:
        """Render the body; `values` must already be validated (see spec loading)."""
        merged = {v.name: v.default for v in self.vars if not v.required}
        merged.update(values)
        try:
            return _compiled(self.body).render(**merged)
        except jinja2.TemplateError as exc:
            raise PatchgenError(f"{self.path}: rendering failed: {exc}") from exc


@functools.lru_cache(maxsize=256)
def _compiled(body: str) -> jinja2.Template:
    """Compiling a jinja2 template costs far more than rendering it; a spec renders each template many times."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    return env.from_string(body)


def parse_template(name: str, path: Path, text: str) -> Template:
    """Split front matter from body and validate the declaration."""
    if not text.startswith("{#"):
        raise PatchgenError(f"{path}: a template must start with a '{{# ... #}}' TOML front matter block")
    end = text.find("#}")
    if end < 0:
        raise PatchgenError(f"{path}: front matter block opened with '{{#' is never closed with '#}}'")
    try:
        meta = tomllib.loads(text[2:end])
    except tomllib.TOMLDecodeError as exc:
        raise PatchgenError(f"{path}: front matter is not valid TOML: {exc}") from exc
    unknown = set(meta) - {"op", "doc", "imports", "vars"}
    if unknown:
        raise PatchgenError(f"{path}: unknown front matter key(s) {sorted(unknown)}; expected op, doc, imports, vars")
    op = meta.get("op")
    if op not in OPS:
        raise PatchgenError(f"{path}: op must be one of {sorted(OPS)}, found {op!r}")
    if not isinstance(meta.get("doc"), str):
        raise PatchgenError(f"{path}: 'doc' (a one-line description of the patch kind) is required")
    imports = meta.get("imports", [])
    if not isinstance(imports, list) or not all(isinstance(i, str) for i in imports):
        raise PatchgenError(f"{path}: 'imports' must be a list of import statements (strings)")
    variables = []
    for var_name, decl in meta.get("vars", {}).items():
        if var_name in BUILTIN_VARS:
            raise PatchgenError(f"{path}: variable {var_name!r} is builtin and cannot be declared")
        if not isinstance(decl, dict) or decl.get("type") not in VAR_TYPES or set(decl) - {"type", "doc", "default"}:
            raise PatchgenError(
                f"{path}: vars.{var_name} must be a table with type (one of {sorted(VAR_TYPES)}), "
                f"doc, and optional default; found {decl!r}"
            )
        var = TemplateVar(var_name, decl["type"], decl.get("doc", ""), decl.get("default", _MISSING))
        if not var.required and not var.accepts(var.default):
            raise PatchgenError(f"{path}: vars.{var_name}: default {var.default!r} is not of type {var.type}")
        variables.append(var)
    body = text[end + 2 :].lstrip("\n")
    return Template(
        name, path, op, meta["doc"], tuple(variables), tuple(imports), body, hashlib.sha256(text.encode()).hexdigest()
    )


def load_template(templates_dir: Path, name: str) -> Template:
    path = templates_dir / f"{name}.py.j2"
    if not path.is_file():
        available = ", ".join(available_templates(templates_dir)) or "none"
        raise PatchgenError(f"unknown template {name!r} (no file {path}); available: {available}")
    return parse_template(name, path, path.read_text(encoding="utf-8"))


def available_templates(templates_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(templates_dir))[: -len(".py.j2")] for p in templates_dir.rglob("*.py.j2"))
