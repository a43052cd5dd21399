"""Per-model patch specs: TOML data -> frozen dataclasses, validated against the templates they name.

Loading a spec parses TOML and reads template front matter; it never executes code from either. Every value that
can reach generated code is validated against a declared kind first (`patchgen.varkinds`); `why` is one line and
only ever lands in comments. What a file may hold is `patchgen.spec_schema`; what it inherits through `extends` is
merged in first (`patchgen.spec_extends`); its `[[companion]]` modules and scope qualifiers are
`patchgen.spec_companions`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from patchgen.accounting import parse_removes
from patchgen.errors import PatchgenError
from patchgen.model import ModelTable, check_unsupported, parse_model_table
from patchgen.ops import OPS
from patchgen.spec_companions import Companion, check_qualifiers, load_companions, parse_scope
from patchgen.spec_extends import INHERITED_FROM, resolve_extends
from patchgen.spec_schema import (
    ANCHOR_KEYS,
    MAX_PATCHES,
    MAX_WHY_CHARS,
    PATCH_KEYS,
    REQUIRED_PATCH_KEYS,
    REQUIRED_SPEC_KEYS,
    SPEC_KEYS,
    check_keys,
    names,
    read_toml,
)
from patchgen.templates import Template, load_template
from patchgen.varkinds import VarError, is_dotted, type_name

_SPEC_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")  # a model name, on the command line and in headers


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
    source: str = field(default="", compare=False)  # "specs/<name>.toml" that states it: generated code names it
    module: str = ""  # `attention_processor` of `scope = "attention_processor:Cls.fn"`; "" when not qualified
    removes: tuple[str, ...] = ()  # statement starts of the upstream statements it deliberately removes

    @property
    def label(self) -> str:
        return f"patch {self.index} ({self.template.name})"

    @property
    def where(self) -> str:
        """The scope as the spec writes it (qualified by its module when the spec says which)."""
        return f"{self.module}:{self.scope}" if self.module else self.scope

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
    sha256: str  # of this file and, for an `extends` spec, of every spec it inherits from
    model: ModelTable | None = None
    extends: tuple[Path, ...] = ()  # the inherited spec files, nearest first
    companions: tuple[Companion, ...] = ()

    @property
    def package(self) -> str:
        """The upstream distribution the module comes from (its top-level package)."""
        return self.module.split(".")[0]

    @property
    def outputs(self) -> tuple[str, ...]:
        """Every module the spec generates: the main output first, then its companions'."""
        return (self.output, *(c.output for c in self.companions))


def _load_patch(index: int, table: Any, path: Path, templates_dir: Path) -> Patch:
    source = f"{path.parent.name}/{path.name}"
    where = f"patch {index}"
    if not isinstance(table, dict):
        raise PatchgenError(f"{path}: {where}: must be a table ([[patch]]), found {type_name(table)}")
    if INHERITED_FROM in table:  # an error names the base spec that states the patch, and where it is inherited
        table = dict(table)
        base_path, base_index = table.pop(INHERITED_FROM)
        where = f"patch {base_index} (inherited by {path.name} as patch {index})"
        path = base_path
    if isinstance(table.get("template"), str):
        where = f"{where} ({table['template']})"
    check_keys(table, PATCH_KEYS, REQUIRED_PATCH_KEYS, path, where)
    try:
        template = load_template(templates_dir, table["template"])
    except PatchgenError as exc:
        raise PatchgenError(f"{path}: {where}: {exc}") from exc
    op = OPS[template.op]
    given = tuple(k for k in ("before", "after", "anchor") if k in table)
    expected = op.check_keys(given)
    if expected is not None:
        raise PatchgenError(f"{path}: {where}: op {op.name!r} takes {expected}; found {list(given) or 'none'}")
    if "through" in table and not op.takes_through:
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
        try:
            var.prepare(value)
        except VarError as exc:
            raise PatchgenError(f"{path}: {where}: vars.{name} must be {exc}") from None
    missing = [v.name for v in template.vars if v.required and v.name not in values]
    if missing:
        docs = "; ".join(v.describe() for v in template.vars if v.name in missing)
        raise PatchgenError(f"{path}: {where}: template {template.name} needs vars {missing}: {docs}")
    removes = ()
    if "removes" in table:
        if not op.replaces:
            raise PatchgenError(
                f"{path}: {where}: 'removes' names upstream statements a patch deletes; op {op.name!r} of template "
                f"{template.name} deletes none: drop the key"
            )
        removes = parse_removes(table["removes"])
        if removes is None:
            raise PatchgenError(
                f"{path}: {where}: key 'removes' must be an array of statement starts (non-empty strings, e.g. "
                f'"loss = None" or "if x is not None:"), found {table["removes"]!r}'
            )
    why = table["why"].strip()
    if not why or not why.isprintable() or len(why) > MAX_WHY_CHARS:
        raise PatchgenError(
            f"{path}: {where}: 'why' must say in one line of at most {MAX_WHY_CHARS} characters (no line breaks or "
            f"control characters) why the patch exists; found {len(why)} characters"
        )
    module, scope = parse_scope(table["scope"], path, where)
    anchors = (table.get(k) for k in ANCHOR_KEYS)
    return Patch(index, template, scope, why, values, *anchors, source=source, module=module, removes=removes)


IMPLIED_CONVERSIONS = "core/upstream_weight_conversions"


def _implied_conversions(
    index: int, model: ModelTable, patches: tuple[Patch, ...], path: Path, templates_dir: Path
) -> Patch:
    """The patch every transformers model gets from its [model] table: its generated classes share upstream's
    checkpoint-layout conversions, so a legacy or per-expert checkpoint never loads as random weights."""
    if any(p.template.name == IMPLIED_CONVERSIONS for p in patches):
        raise PatchgenError(
            f"{path}: a [model] table with a transformers upstream implies the {IMPLIED_CONVERSIONS} patch; remove "
            f"the explicit one (or set [model] conversions = false and keep it)"
        )
    try:
        template = load_template(templates_dir, IMPLIED_CONVERSIONS)
    except PatchgenError as exc:
        raise PatchgenError(
            f"{path}: [model] implies the {IMPLIED_CONVERSIONS} patch, but: {exc}; add the template or set "
            f"[model] conversions = false"
        ) from None
    why = "implied by [model]: generated classes load every checkpoint layout upstream accepts, and save upstream's"
    return Patch(index, template, "<module>", why, {"model_type": model.model_type})


def load_spec(path: Path, templates_dir: Path) -> Spec:
    if not _SPEC_NAME.fullmatch(path.stem):
        raise PatchgenError(
            f"{path.parent}: spec file {path.name!r}: a model's name (the file name without .toml) may hold only "
            f"ASCII letters, digits, _ and -, and must not start with -; rename the file"
        )
    own, raw = read_toml(path)
    check_keys(own, SPEC_KEYS, ("module", "output") if "extends" in own else REQUIRED_SPEC_KEYS, path, "")
    data, inherited_raw, inherited_paths = resolve_extends(own, path, templates_dir)
    check_keys(data, SPEC_KEYS, REQUIRED_SPEC_KEYS, path, "")
    keep = names(data["keep"], path, "keep")
    if not keep:
        raise PatchgenError(f"{path}: key 'keep' must name at least one root definition to keep")
    if not is_dotted(data["module"]):
        raise PatchgenError(f"{path}: key 'module' must be a dotted module name, found {data['module']!r}")
    if not data["output"].endswith(".py") or Path(data["output"]).is_absolute():
        raise PatchgenError(f"{path}: key 'output' must be a relative path ending in .py, found {data['output']!r}")
    if len(data.get("patch", [])) > MAX_PATCHES:
        raise PatchgenError(
            f"{path}: {len(data['patch'])} patches; at most {MAX_PATCHES} per spec: split the model's patches over "
            f"fewer, larger templates"
        )
    patches = tuple(_load_patch(i, t, path, templates_dir) for i, t in enumerate(data.get("patch", []), start=1))
    companions = load_companions(data, path)
    check_qualifiers(patches, data["module"], companions, path)
    model = parse_model_table(data["model"], str(path)) if "model" in data else None
    if model is not None and model.implies_conversions:
        patches = (*patches, _implied_conversions(len(patches) + 1, model, patches, path, templates_dir))
    if model is not None:
        check_unsupported(model, ((p.template.name, p.scope, p.vars) for p in patches), str(path))
    digest = hashlib.sha256(raw)
    for extra in inherited_raw:
        digest.update(b"\0" + hashlib.sha256(extra).digest())
    return Spec(
        path.stem,
        path,
        data["module"],
        data["output"],
        keep,
        names(data.get("exclude", []), path, "exclude"),
        patches,
        digest.hexdigest(),
        model,
        tuple(inherited_paths),
        companions,
    )
