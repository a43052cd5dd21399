"""Per-model patch specs: TOML data -> frozen dataclasses, validated against the templates they name.

Loading a spec parses TOML and reads template front matter; it never executes code from either. Every value that
can reach generated code is validated against a declared kind first (`patchgen.varkinds`); `why` is one line and
only ever lands in comments.

A spec may `extends = "<other spec>"`: it inherits that spec's keep/exclude roots, companions, patches and `[model]`
table, with `class_prefix = { from = "Qwen3VL", to = "Qwen3VLMoe" }` renaming every class name that starts with
`from` (in scopes, anchors, roots and code-valued vars), then appends its own patches, overrides what it names and
drops the inherited `[model]` keys its `remove` list names.

A spec may also patch definitions its module imports from other modules of the same distribution: each
`[[companion]]` names such a module and the definitions to redefine (`keep`); it is generated beside the main output
(`patchgen.units`). A patch's scope names a definition of any of them, qualified as `<module>:<scope>` (the module's
last dotted component) when the name alone is not unique.
"""

from __future__ import annotations

import copy
import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from patchgen.errors import PatchgenError
from patchgen.model import ModelTable, merge_tables, parse_model_table
from patchgen.ops import OPS
from patchgen.templates import Template, load_template
from patchgen.varkinds import VarError, is_dotted, is_identifier, type_name

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
}
REQUIRED_PATCH_KEYS = ("template", "scope", "why")
ANCHOR_KEYS = ("before", "after", "anchor", "through")
MAX_EXTENDS_DEPTH = 4
CODE_KINDS = ("identifier", "dotted", "expr")  # var kinds whose values class_prefix renames
# Limits that make hostile or runaway input fail fast and clearly instead of exhausting memory or time.
MAX_SPEC_BYTES = 1 << 20  # a spec file, and each one it extends
MAX_PATCHES = 256
MAX_NAMES = 256  # entries of `keep` and of `exclude`
MAX_WHY_CHARS = 300  # a `why` is one line of a comment
MAX_COMPANIONS = 16  # [[companion]] modules of one spec
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
class Companion:
    """A module of the spec's upstream distribution whose `keep` definitions the spec redefines: generated as
    `<output folder>/<last module component>.py`, and every generated file of the spec imports them from there."""

    module: str
    keep: tuple[str, ...]
    output: str

    @property
    def name(self) -> str:
        return self.module.rsplit(".", 1)[-1]


def companion_output(output: str, module: str) -> str:
    """Where the companion `module` of a spec with this `output` is generated: the main output's folder."""
    return str(PurePosixPath(output).parent / f"{module.rsplit('.', 1)[-1]}.py")


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


def _a(noun: str) -> str:
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


def _check_keys(table: dict, allowed: dict, required: tuple, path: Path, where: str) -> None:
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


def _names(value: list, path: Path, key: str) -> tuple[str, ...]:
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


def _is_scope(scope: str) -> bool:
    return scope == "<module>" or is_dotted(scope)


def split_scope(scope: str) -> tuple[str, str]:
    """`attention_processor:Cls.fn` -> ("attention_processor", "Cls.fn"); an unqualified scope -> ("", scope)."""
    module, sep, rest = scope.partition(":")
    return (module, rest) if sep else ("", scope)


def _load_patch(index: int, table: Any, path: Path, templates_dir: Path) -> Patch:
    where = f"patch {index}"
    if not isinstance(table, dict):
        raise PatchgenError(f"{path}: {where}: must be a table ([[patch]]), found {type_name(table)}")
    if isinstance(table.get("template"), str):
        where = f"patch {index} ({table['template']})"
    _check_keys(table, PATCH_KEYS, REQUIRED_PATCH_KEYS, path, where)
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
    why = table["why"].strip()
    if not why or not why.isprintable() or len(why) > MAX_WHY_CHARS:
        raise PatchgenError(
            f"{path}: {where}: 'why' must say in one line of at most {MAX_WHY_CHARS} characters (no line breaks or "
            f"control characters) why the patch exists; found {len(why)} characters"
        )
    module, scope = split_scope(table["scope"])
    if not _is_scope(scope) or module and not is_identifier(module):
        raise PatchgenError(
            f"{path}: {where}: 'scope' must be '<module>', a top-level name or a dotted path such as Class.method, "
            f"optionally qualified by the module that defines it (attention_processor:Class.method); "
            f"found {table['scope']!r}"
        )
    anchors = (table.get(k) for k in ANCHOR_KEYS)
    source = f"{path.parent.name}/{path.name}"
    return Patch(index, template, scope, why, values, *anchors, source=source, module=module)


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


def _prefix_renamer(rule: Any, path: Path):
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
    """A base spec's patch table with class names renamed in its scope, anchors and code-valued vars."""
    out = dict(patch)
    for key in ("scope", *ANCHOR_KEYS):
        if isinstance(out.get(key), str):
            out[key] = rename(out[key])
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


def _resolve_extends(data: dict, path: Path, templates_dir: Path, depth: int = 0) -> tuple[dict, list[bytes], list]:
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
    base, raws, paths = _resolve_extends(base, base_path, templates_dir, depth + 1)
    rename = _prefix_renamer(data["class_prefix"], path) if "class_prefix" in data else (lambda text: text)
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
        _renamed_patch(p, rename, templates_dir, base_path) if isinstance(p, dict) else p for p in inherited
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


def load_spec(path: Path, templates_dir: Path) -> Spec:
    if not _SPEC_NAME.fullmatch(path.stem):
        raise PatchgenError(
            f"{path.parent}: spec file {path.name!r}: a model's name (the file name without .toml) may hold only "
            f"ASCII letters, digits, _ and -, and must not start with -; rename the file"
        )
    own, raw = read_toml(path)
    _check_keys(own, SPEC_KEYS, ("module", "output") if "extends" in own else REQUIRED_SPEC_KEYS, path, "")
    data, inherited_raw, inherited_paths = _resolve_extends(own, path, templates_dir)
    _check_keys(data, SPEC_KEYS, REQUIRED_SPEC_KEYS, path, "")
    keep = _names(data["keep"], path, "keep")
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
    companions = _companions(data, path)
    names = [data["module"].rsplit(".", 1)[-1], *(c.name for c in companions)]
    for patch in patches:
        if patch.module and patch.module not in names:
            raise PatchgenError(
                f"{path}: {patch.label}: scope {patch.where!r}: {patch.module!r} is neither the spec's module nor a "
                f"companion; qualify a scope by the last component of one of {names}"
            )
    model = parse_model_table(data["model"], str(path)) if "model" in data else None
    if model is not None and model.implies_conversions:
        patches = (*patches, _implied_conversions(len(patches) + 1, model, patches, path, templates_dir))
    digest = hashlib.sha256(raw)
    for extra in inherited_raw:
        digest.update(b"\0" + hashlib.sha256(extra).digest())
    return Spec(
        path.stem,
        path,
        data["module"],
        data["output"],
        keep,
        _names(data.get("exclude", []), path, "exclude"),
        patches,
        digest.hexdigest(),
        model,
        tuple(inherited_paths),
        companions,
    )


def _companions(data: dict, path: Path) -> tuple[Companion, ...]:
    """The `[[companion]]` tables: modules of the spec's own distribution, each generated beside the output under
    its last module component, which must differ from the main module's and every other companion's."""
    tables = data.get("companion", [])
    if len(tables) > MAX_COMPANIONS:
        raise PatchgenError(f"{path}: {len(tables)} [[companion]] tables; at most {MAX_COMPANIONS} per spec")
    out: list[Companion] = []
    main = data["module"]
    for number, table in enumerate(tables, start=1):
        where = f"companion {number}"
        if not isinstance(table, dict):
            raise PatchgenError(f"{path}: {where}: must be a table ([[companion]]), found {type_name(table)}")
        _check_keys(table, COMPANION_KEYS, tuple(COMPANION_KEYS), path, where)
        module = table["module"]
        if not is_dotted(module) or module.split(".")[0] != main.split(".")[0] or module == main:
            raise PatchgenError(
                f"{path}: {where}: module {module!r} must be another module of {main.split('.')[0]!r}, the "
                f"distribution of the spec's module {main!r} (e.g. {main.split('.')[0]}.models.attention_processor)"
            )
        keep = _names(table["keep"], path, f"companion {number} keep")
        if not keep:
            raise PatchgenError(f"{path}: {where}: 'keep' must name the definitions of {module} the spec redefines")
        companion = Companion(module, keep, companion_output(data["output"], module))
        taken = [main.rsplit(".", 1)[-1], PurePosixPath(data["output"]).stem, *(c.name for c in out)]
        if companion.name in taken:
            raise PatchgenError(
                f"{path}: {where}: module {module!r} would be generated as {companion.output}, which another module "
                f"of this spec already uses (its last component {companion.name!r} must be unique)"
            )
        out.append(companion)
    return tuple(out)
