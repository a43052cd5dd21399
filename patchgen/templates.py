"""Patch kinds: one jinja2 file each, with a TOML front matter declaring its operation, variables and imports.

A template file looks like::

    {#
    op = "wrap"
    doc = "Keep this SP rank's slice of the RoPE table computed from global position ids."
    imports = ["from runtime.sp.positions import slice_position_embeddings"]
    [vars.seq_dim]
    kind = "int"
    default = 1
    doc = "sequence dimension of cos/sin"
    #}
    slice_position_embeddings({{ expr }}, seq_dim={{ seq_dim }})

The front matter is data (TOML). Every variable declares a kind (`patchgen.varkinds`) and spec values are validated
against it before rendering; the body renders in jinja2's immutable sandbox with StrictUndefined and no globals, so a
template can neither reach Python internals nor render a missing variable as an empty string, and within limits of
size and work (`patchgen.sandbox`), so it cannot exhaust the machine either.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from patchgen.accounting import PLACEHOLDER_KINDS, Reimplemented, parse_reimplements
from patchgen.cst.attention_calls import AttentionCall
from patchgen.errors import PatchgenError
from patchgen.ops import OPS
from patchgen.sandbox import BoundedEnvironment, render
from patchgen.varkinds import Kind, VarError, is_identifier, parse_kind, prepare

BUILTIN_VARS = ("expr", "scope")
MAX_TEMPLATE_BYTES = 256 << 10  # a template is one patch kind: a few dozen lines
_TEMPLATE_NAME = re.compile(r"[A-Za-z0-9_]+(/[A-Za-z0-9_]+)*\Z")
_MISSING = object()


@dataclass(frozen=True)
class TemplateVar:
    name: str
    kind: Kind
    doc: str
    default: Any = _MISSING
    choices: tuple[str, ...] = ()
    binds: bool = False  # an identifier the template assigns (a new local name): never checked as a reference
    module_level: bool = False  # an identifier naming a definition or import of the module (a class), never a local
    min_items: int = 0  # a list the rendered code cannot do without (an empty one would render invalid Python)

    @property
    def required(self) -> bool:
        return self.default is _MISSING

    def prepare(self, value: Any) -> Any:
        """The template input for a spec value; raises VarError when the value does not fit the kind."""
        prepared = prepare(self.kind, value, self.choices)
        if self.kind.is_list and len(prepared) < self.min_items:
            raise VarError(
                f"an array of at least {self.min_items} item{'s' if self.min_items > 1 else ''} ({self.doc}), found "
                f"{value!r}: name them, or drop the patch"
            )
        return prepared

    def describe(self) -> str:
        choices = f" of {list(self.choices)}" if self.choices else ""
        return f"{self.name} ({self.kind.name}{choices}): {self.doc}"


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
    reimplements: tuple[Reimplemented, ...] = ()  # upstream statements a replacing template's code re-implements
    attention_call: AttentionCall | None = None  # a stated layout checked against the anchored call (inserts)

    def var(self, name: str) -> TemplateVar | None:
        return next((v for v in self.vars if v.name == name), None)

    def render(self, values: dict[str, Any], builtins: dict[str, str] | None = None) -> str:
        """Render the body from spec values (validated again here, so no path renders an unchecked value) and the
        engine's builtin variables (`scope`, and `expr` for wraps: code the engine itself produced)."""
        merged = {}
        for var in self.vars:
            if var.name in values:
                value = values[var.name]
            elif not var.required:
                value = var.default
            else:
                raise PatchgenError(f"{self.path}: variable {var.name!r} has no value")
            try:
                merged[var.name] = var.prepare(value)
            except VarError as exc:
                raise PatchgenError(f"{self.path}: vars.{var.name} must be {exc}") from exc
        merged.update(builtins or {})
        try:
            return render(_compiled(self.body), merged)
        except RecursionError as exc:
            raise PatchgenError(f"{self.path}: rendering failed: nested too deeply") from exc
        except Exception as exc:  # a template is input: whatever fails in it (1 / 0 too) is the template's error
            text = " ".join(str(exc).split()) or type(exc).__name__
            raise PatchgenError(f"{self.path}: rendering failed: {text}") from exc


_ENV = BoundedEnvironment()


@functools.lru_cache(maxsize=256)
def _compiled(body: str) -> jinja2.Template:
    """Compiling a jinja2 template costs far more than rendering it; a spec renders each template many times."""
    return _ENV.from_string(body)


def _parse_var(path: Path, var_name: str, decl: Any) -> TemplateVar:
    where = f"{path}: vars.{var_name}"
    if var_name in BUILTIN_VARS:
        raise PatchgenError(f"{where}: {var_name!r} is builtin and cannot be declared")
    if not is_identifier(var_name):
        raise PatchgenError(f"{where}: a variable name must be a Python identifier")
    if not isinstance(decl, dict):
        raise PatchgenError(f"{where} must be a table with kind, doc and optional default/choices; found {decl!r}")
    unknown = set(decl) - {"kind", "doc", "default", "choices", "binds", "module_level", "min_items"}
    if "type" in decl:
        raise PatchgenError(
            f"{where}: 'type' is now 'kind' (one of int, float, bool, identifier, dotted, expr, str, "
            f"word, or list[...] of them)"
        )
    if unknown:
        raise PatchgenError(
            f"{where}: unknown key(s) {sorted(unknown)}; expected kind, doc, default, choices, binds, module_level, "
            f"min_items"
        )
    kind = parse_kind(decl.get("kind"))
    if kind is None:
        raise PatchgenError(
            f"{where}: kind must be one of int, float, bool, identifier, dotted, expr, str, word or "
            f"list[<one of those>]; found {decl.get('kind')!r}"
        )
    if not isinstance(decl.get("doc", ""), str):
        raise PatchgenError(f"{where}: doc must be a string")
    choices = decl.get("choices", [])
    if (kind.scalar == "word") != bool(choices) or not all(isinstance(c, str) and is_identifier(c) for c in choices):
        raise PatchgenError(
            f"{where}: kind word (or list[word]) needs choices = [...] of identifiers, and only it "
            f"takes choices; found kind {kind.name!r}, choices {choices!r}"
        )
    binds = decl.get("binds", False)
    if not isinstance(binds, bool) or binds and kind.scalar != "identifier":
        raise PatchgenError(
            f"{where}: binds = true marks an identifier (or list[identifier]) the template assigns, so it is not "
            f"checked as a name the generated module must define; found binds = {binds!r} on kind {kind.name!r}"
        )
    module_level = decl.get("module_level", False)
    if not isinstance(module_level, bool) or module_level and (kind.scalar != "identifier" or binds):
        raise PatchgenError(
            f"{where}: module_level = true marks an identifier (or list[identifier]) that must name a definition or "
            f"import of the generated module (not one the template binds); found module_level = {module_level!r} "
            f"on kind {kind.name!r}"
        )
    min_items = decl.get("min_items", 0)
    if type(min_items) is not int or min_items < 0 or min_items and not kind.is_list:
        raise PatchgenError(f"{where}: min_items is a count (>= 0) of list items; found {min_items!r} ({kind.name})")
    default = decl.get("default", _MISSING)
    var = TemplateVar(var_name, kind, decl.get("doc", ""), default, tuple(choices), binds, module_level, min_items)
    if not var.required:
        try:
            var.prepare(var.default)
        except VarError as exc:
            raise PatchgenError(f"{where}: default must be {exc}") from exc
    return var


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
    unknown = set(meta) - {"op", "doc", "imports", "vars", "reimplements", "attention_call"}
    if unknown:
        raise PatchgenError(
            f"{path}: unknown front matter key(s) {sorted(unknown)}; expected op, doc, imports, vars, reimplements, "
            f"attention_call"
        )
    op = meta.get("op")
    if op not in OPS:
        raise PatchgenError(f"{path}: op must be one of {sorted(OPS)}, found {op!r}")
    if not isinstance(meta.get("doc"), str):
        raise PatchgenError(f"{path}: 'doc' (a one-line description of the patch kind) is required")
    imports = meta.get("imports", [])
    if not isinstance(imports, list) or not all(isinstance(i, str) for i in imports):
        raise PatchgenError(f"{path}: 'imports' must be a list of import statements (strings)")
    for number, line in enumerate(imports):
        if not _is_import(line):
            raise PatchgenError(
                f"{path}: imports[{number}] = {line!r} must be one import statement on one line "
                f"(`import a.b` or `from a.b import c`)"
            )
    declared = meta.get("vars", {})
    if not isinstance(declared, dict):
        raise PatchgenError(f"{path}: 'vars' must be a table of variable declarations")
    variables = tuple(_parse_var(path, var_name, decl) for var_name, decl in declared.items())
    reimplements = ()
    if "reimplements" in meta:
        if not OPS[op].replaces:
            raise PatchgenError(f"{path}: 'reimplements' is for templates whose op replaces upstream code, not {op!r}")
        defaults = {v.name: not v.required for v in variables}
        names = tuple(v.name for v in variables if not v.kind.is_list and v.kind.scalar in PLACEHOLDER_KINDS)
        parsed = parse_reimplements(meta["reimplements"], defaults, names, str(path))
        if isinstance(parsed, str):
            raise PatchgenError(parsed)
        reimplements = parsed
    body = text[end + 2 :].lstrip("\n")
    try:
        _compiled(body)
    except jinja2.TemplateSyntaxError as exc:
        raise PatchgenError(f"{path}:{exc.lineno}: template body is not valid jinja2: {exc.message}") from exc
    digest = hashlib.sha256(text.encode()).hexdigest()
    call = _attention_call(path, op, meta.get("attention_call"), variables)
    return Template(name, path, op, meta["doc"], variables, tuple(imports), body, digest, reimplements, call)


def _attention_call(path: Path, op: str, table: Any, variables: tuple[TemplateVar, ...]) -> AttentionCall | None:
    """``[attention_call]``: which vars state an insert's attention layout and name its tensors
    (``patchgen.cst.attention_calls``)."""
    if table is None:
        return None
    declared = {v.name for v in variables}
    fits = (
        isinstance(table, dict)
        and set(table) == {"dims", "tensors", "side"}
        and table["side"] in ("arguments", "result")
        and {table["dims"], table["tensors"]} <= declared
    )
    if op != "insert" or not fits:
        raise PatchgenError(
            f"{path}: [attention_call] takes dims and tensors (names of declared vars) and side (arguments or "
            f"result), for an insert beside an attention call; found {table!r} on op {op!r}"
        )
    return AttentionCall(table["dims"], table["tensors"], table["side"])


def _is_import(line: str) -> bool:
    """One `import`/`from ... import` statement: the rewrite inserts each line into the module as it is."""
    try:
        body = ast.parse(line).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return "\n" not in line.strip() and len(body) == 1 and isinstance(body[0], ast.Import | ast.ImportFrom)


def template_path(templates_dir: Path, name: str) -> Path:
    """`family/kind` -> its file, refusing any name that could leave the templates directory."""
    if not isinstance(name, str) or not _TEMPLATE_NAME.match(name):
        raise PatchgenError(f"template name {name!r} must be family/kind: letters, digits and _ separated by '/'")
    root = templates_dir.resolve()
    path = (templates_dir / f"{name}.py.j2").resolve()
    if not path.is_relative_to(root):
        raise PatchgenError(f"template {name!r} resolves to {path}, outside the templates directory {root}")
    return path


def load_template(templates_dir: Path, name: str) -> Template:
    path = template_path(templates_dir, name)
    if not path.is_file():
        available = ", ".join(available_templates(templates_dir)) or "none"
        raise PatchgenError(
            f"unknown template {name!r} (no file {templates_dir / (name + '.py.j2')}); available: {available}"
        )
    try:
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise PatchgenError(f"{path}: larger than {MAX_TEMPLATE_BYTES // 1024} KiB; a template is one patch kind")
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PatchgenError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise PatchgenError(f"{path}: cannot read the template: {exc.strerror}") from exc
    return parse_template(name, path, text)


def available_templates(templates_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(templates_dir))[: -len(".py.j2")] for p in templates_dir.rglob("*.py.j2"))
