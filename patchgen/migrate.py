"""`patchgen upgrade --migrate`: propose the spec edits a new release needs, only where a rule is sure.

Two rules (stated for users in docs/upgrading-transformers.md), tried on each patch that does not apply:
1. moved anchor: in the patch's scope, exactly one statement of the anchor's kind has the same meaning (equal after
   normalising formatting and typing spellings; or, for an assignment, the same targets and the same called function
   chain, only call arguments changed), it is the strictly nearest statement of that kind, and its text is unique
   there.
   A template variable whose value (given or default) is a call argument that changed follows the argument.
2. moved scope: the scope's definition is gone (renamed, or moved to another class) and the unchanged anchor matches
   exactly once in the whole module, inside one definition of the same kind (class / function). When the old scope
   still exists, code that left it was refactored, not renamed: that is left to the human.
A proposal is then checked the way it will be used: the edited spec files are loaded, resolved against the new
release, and refused when the patch still does not apply or its rendered code reads a local name the old scope bound
and the new one does not (the template would read a name upstream removed). Anything else is left to the human.
Edits change one TOML value in place (comments and layout kept) and land in a reviewable diff; specs/ is written
only on `--apply-specs`.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import json
import os
import re
import shutil
import tempfile
import textwrap
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from patchgen.config import ProjectConfig
from patchgen.cst.locate import (
    ANCHOR_MOVED,
    SCOPE_MISSING,
    LocateError,
    NodeIndex,
    code_of,
    find_scope,
    find_statement,
    normalize,
    normalize_anchor,
    statement_shape,
)
from patchgen.cst.plan import PlanError, resolve_each
from patchgen.errors import PatchgenError
from patchgen.generate import UnitSource, read_unit, with_patches
from patchgen.spec import Patch, Spec, _prefix_renamer, load_spec
from patchgen.units import units as spec_units
from patchgen.upgrade import REVIEW_DIR, PatchStatus, Upgrade
from patchgen.upstream import UpstreamSource

_TYPING_BUILTINS = {"List", "Dict", "Tuple", "Set", "FrozenSet", "Type"}


@dataclass(frozen=True)
class SpecEdit:
    path: Path  # the spec file stating the patch (the base spec for an inherited patch)
    table: int  # its [[patch]] table in that file, 1-based
    key: str  # anchor / before / after / through / scope / vars.<name>
    old: str | None
    new: str


@dataclass(frozen=True)
class Outcome:
    model: str
    status: PatchStatus
    edits: tuple[SpecEdit, ...]  # empty: left to the human
    reason: str  # the rule that migrated it, or why it was left


@dataclass(frozen=True)
class Migration:
    outcomes: tuple[Outcome, ...]
    texts: dict[Path, str]  # every edited spec file's new text
    diff: str  # unified diff of specs/, paths relative to the project root
    before: tuple[int, int]  # (patches applying, patches) with the pinned specs
    after: tuple[int, int]  # the same with the migrated specs, re-resolved against the new release


# ---- rule 1: what "the same meaning" is ---------------------------------------------------------------------


class _Canonical(ast.NodeTransformer):
    """Spellings upstream rewrites without changing meaning: Optional[X] -> X | None, Union[A, B] -> A | B,
    typing.List[...] (Dict, Tuple, Set, FrozenSet, Type) -> list[...]."""

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        node = self.generic_visit(node)
        name = ast.unparse(node.value)
        base = name.removeprefix("typing.")
        if "." in base:
            return node
        if base == "Optional":
            return ast.BinOp(node.slice, ast.BitOr(), ast.Constant(None))
        if base == "Union":
            parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            out = parts[0]
            for part in parts[1:]:
                out = ast.BinOp(out, ast.BitOr(), part)
            return out
        if base in _TYPING_BUILTINS:
            node.value = ast.Name(base.lower(), ast.Load())
        return node


def canonical(code: str) -> str:
    return ast.unparse(_Canonical().visit(ast.parse(code)))


def _chain(expr: ast.expr) -> list[ast.Call]:
    """The calls along a callee chain, outermost first: `torch.cat(a).to(b)` -> [.to(b), torch.cat(a)]."""
    calls, node = [], expr
    while isinstance(node, ast.Call | ast.Attribute):
        if isinstance(node, ast.Call):
            calls.append(node)
            node = node.func
        else:
            node = node.value
    return calls


def _skeleton(expr: ast.expr) -> str:
    """The callee chain without its arguments: `torch.cat(a, dim=0).to(b)` -> `torch.cat().to()`."""
    bare = copy.deepcopy(expr)
    for call in _chain(bare):
        call.args, call.keywords = [], []
    return ast.unparse(bare)


def _argument_pairs(old: ast.Call, new: ast.Call) -> list[tuple[str, str]] | None:
    """(old, new) text of every argument that changed, matched by position and keyword; None when they cannot be
    matched (a different number of positional arguments, or other keywords)."""
    if len(old.args) != len(new.args) or [k.arg for k in old.keywords] != [k.arg for k in new.keywords]:
        return None
    olds, news = [*old.args, *(k.value for k in old.keywords)], [*new.args, *(k.value for k in new.keywords)]
    pairs = zip(olds, news, strict=True)
    return [(ast.unparse(a), ast.unparse(b)) for a, b in pairs if ast.unparse(a) != ast.unparse(b)]


def same_meaning(old: str, new: str) -> tuple[str, list[tuple[str, str]] | None] | None:
    """Why two normalized statements mean the same (and the call arguments that changed), or None.

    Equal after `canonical`; or both a single assignment of the same kind to the same targets from a call with the
    same callee chain, where only arguments differ. Anything else (another callee, another target, a compound
    header that changed) is not the same meaning."""
    if canonical(old) == canonical(new):
        return "equal after normalising formatting and typing spellings", []
    a, b = ast.parse(old).body, ast.parse(new).body
    if len(a) != 1 or len(b) != 1 or type(a[0]) is not type(b[0]):
        return None
    a, b = a[0], b[0]
    if not isinstance(a, ast.Assign | ast.AnnAssign | ast.AugAssign) or not isinstance(a.value, ast.Call):
        return None
    if not isinstance(b.value, ast.Call) or _targets(a) != _targets(b) or _skeleton(a.value) != _skeleton(b.value):
        return None
    pairs: list[tuple[str, str]] | None = []
    for x, y in zip(_chain(a.value), _chain(b.value), strict=True):
        more = _argument_pairs(x, y)
        pairs = None if more is None or pairs is None else pairs + more
    return f"same targets and callee `{_skeleton(b.value)}`, only call arguments changed", pairs


def _targets(stmt: ast.stmt) -> str:
    """What a statement assigns to: its targets, an augmented one's operator, an annotated one's annotation."""
    if isinstance(stmt, ast.Assign):
        return " = ".join(canonical(ast.unparse(t)) for t in stmt.targets)
    if isinstance(stmt, ast.AugAssign):
        return canonical(ast.unparse(stmt.target)) + type(stmt.op).__name__
    return canonical(ast.unparse(stmt.target)) + ": " + canonical(ast.unparse(stmt.annotation))


# ---- proposing ----------------------------------------------------------------------------------------------


def _failed_key(patch: Patch, scope: cst.CSTNode, index: NodeIndex) -> str:
    """Which anchor key of the patch no longer matches (`through` when only the end of its run moved)."""
    key = next(k for k in ("before", "after", "anchor") if getattr(patch, k))
    if patch.through is None or patch.template.op == "wrap":
        return key
    try:
        find_statement(scope, patch.anchor_text, patch.scope, index)
    except LocateError:
        return key
    return "through"


def _header(key: str) -> str:
    return key.splitlines()[0] if "\n" in key else key


def _anchor_rule(patch: Patch, module: cst.Module) -> tuple[dict[str, str], str] | str:
    """Rule 1: the edits (key -> new value) and the reason, or why the anchor is left to the human."""
    scope = find_scope(module, patch.scope)
    index = NodeIndex()
    key = _failed_key(patch, scope, index)
    old = getattr(patch, key)
    if patch.template.op == "wrap":
        wanted = normalize(old, "eval")
        pool = [(n, normalize(code_of(n), "eval")) for n in _expressions(scope, index)]
    else:
        wanted = normalize_anchor(old)
        shape = tuple(type(n).__name__ for n in ast.parse(wanted).body)
        pool = [(s, index.statement_key(s)) for s in index.statements(scope) if statement_shape(s) == shape]
    pool = [(n, k) for n, k in pool if k]
    if not pool:
        return f"no {'expression' if patch.template.op == 'wrap' else 'statement'} of the anchor's kind is left"
    ratio = {id(n): difflib.SequenceMatcher(None, wanted, k).ratio() for n, k in pool}
    fits = []
    for node, text in pool:
        verdict = (
            same_meaning(wanted, text)
            if patch.template.op != "wrap"
            else (("equal after normalising formatting", []) if canonical(wanted) == canonical(text) else None)
        )
        if verdict is not None:
            fits.append((node, text, *verdict))
    if not fits:
        nearest = max(pool, key=lambda p: ratio[id(p[0])])[1]
        return f"{key}: no statement of its kind has the same meaning (nearest `{_header(nearest)}`)"
    if len(fits) > 1:
        return f"{key}: {len(fits)} candidates are equally eligible: " + "; ".join(
            f"`{_header(t)}`" for _, t, *_ in fits
        )
    node, text, why, pairs = fits[0]
    rivals = [k for n, k in pool if n is not node and ratio[id(n)] >= ratio[id(node)] and k != text]
    if rivals:
        return f"{key}: `{_header(rivals[0])}` is as near as the eligible `{_header(text)}`"
    if sum(k == text for _, k in pool) > 1:
        return f"{key}: the eligible `{_header(text)}` occurs {sum(k == text for _, k in pool)} times in the scope"
    edits = {key: _header(text)}
    for old_arg, new_arg in pairs or []:
        for var in patch.template.vars:
            value = patch.vars.get(var.name, None if var.required else var.default)
            if var.kind.scalar == "expr" and isinstance(value, str) and normalize(value, "eval") == old_arg:
                edits[f"vars.{var.name}"] = new_arg
    follows = ", ".join(f"vars.{k.split('.', 1)[1]}" for k in edits if k.startswith("vars."))
    return edits, f"rule 1 (moved anchor): {why}" + (f"; {follows} follows the changed argument" if follows else "")


def _expressions(scope: cst.CSTNode, index: NodeIndex) -> list[cst.CSTNode]:
    kinds = (cst.Name, cst.Attribute, cst.Call, cst.BinaryOperation, cst.Subscript)
    return [n for kind in kinds for n in index.of_type(scope, kind)]


def _definitions(node: cst.CSTNode, prefix: str = ""):
    body = node.body if isinstance(node, cst.Module) else getattr(node.body, "body", ())
    for child in body:
        if isinstance(child, cst.ClassDef | cst.FunctionDef):
            yield prefix + child.name.value, child
            yield from _definitions(child, f"{prefix}{child.name.value}.")


def _holders(module: cst.Module, patch: Patch) -> dict[str, int]:
    """Every definition (innermost) holding a match of the unchanged anchor, with its number of matches."""
    text, wrap = patch.anchor_text, patch.template.op == "wrap"
    wanted = normalize(text, "eval") if wrap else normalize_anchor(text)
    index, owner = NodeIndex(), {}
    for name, definition in _definitions(module):  # outermost first: an inner definition overwrites its parent
        if wrap:
            hits = [n for n in _expressions(definition, index) if normalize(code_of(n), "eval") == wanted]
        else:
            hits = [s for s in index.statements(definition) if index.statement_key(s) == wanted]
        owner.update({id(h): name for h in hits if h is not definition})
    counts: dict[str, int] = {}
    for name in owner.values():
        counts[name] = counts.get(name, 0) + 1
    return counts


def _scope_rule(patch: Patch, module: cst.Module, old_module: cst.Module | None) -> tuple[dict[str, str], str] | str:
    """Rule 2: the new scope, or why the scope is left to the human."""
    if patch.anchor_text is None or patch.scope == "<module>":
        return "no anchor to follow to another scope"
    holders = {k: v for k, v in _holders(module, patch).items() if k != patch.scope}
    if len(holders) != 1:
        where = ", ".join(sorted(holders)) or "no definition"
        return f"scope {patch.scope} is gone; the unchanged anchor is in {where}, not in exactly one other definition"
    ((scope, count),) = holders.items()
    if count != 1:
        return f"scope: the unchanged anchor matches {count} times in {scope}"
    kind = type(find_scope(module, scope))
    if old_module is not None:
        try:
            if type(find_scope(old_module, patch.scope)) is not kind:
                return f"scope: {scope} is not the same kind of definition as {patch.scope}"
        except LocateError:
            pass
    qualified = f"{patch.module}:{scope}" if patch.module else scope
    return {"scope": qualified}, f"rule 2 (moved scope): the unchanged anchor matches once, only in `{scope}`"


def propose(error: PlanError, new: UnitSource, old: UnitSource | None) -> tuple[dict[str, str], str] | str:
    """The edits (spec key -> new value, in the spec's naming) that would make a failing patch apply, or why not."""
    patch = error.patch
    old_module = old.module if old is not None else None
    try:
        if error.kind == ANCHOR_MOVED:
            found = _anchor_rule(patch, new.module)
            if isinstance(found, str) and patch.anchor_text and patch.scope != "<module>":
                elsewhere = sorted(set(_holders(new.module, patch)) - {patch.scope})
                if elsewhere:  # a hint only: the scope still exists, so the code was refactored, not renamed
                    found += f"; the unchanged anchor is now in {', '.join(elsewhere)} (the old scope still exists)"
            return found
        if error.kind == SCOPE_MISSING:
            return _scope_rule(patch, new.module, old_module)
    except (LocateError, SyntaxError, cst.ParserSyntaxError) as exc:
        return f"cannot analyse: {getattr(exc, 'message', exc)}"
    return f"no migration rule for `{error.kind}`"


# ---- where a patch is written, and editing it in place --------------------------------------------------------


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
            rename = _prefix_renamer(data["class_prefix"], path) if "class_prefix" in data else (lambda t: t)
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


# ---- checking proposals the way they will be used -------------------------------------------------------------


def _locals(node: cst.CSTNode) -> set[str]:
    if not isinstance(node, cst.FunctionDef):
        return set()
    tree = ast.parse(textwrap.dedent(code_of(node)))
    names = set()
    for sub in ast.walk(tree.body[0]):
        if isinstance(sub, ast.Name) and not isinstance(sub.ctx, ast.Load):
            names.add(sub.id)
        elif isinstance(sub, ast.arg):
            names.add(sub.arg)
        elif isinstance(sub, ast.alias):
            names.add((sub.asname or sub.name).split(".")[0])
        elif isinstance(sub, ast.ExceptHandler) and sub.name:
            names.add(sub.name)
    return names


def dangling(rendered: list[str], old_scope: cst.CSTNode | None, new_scope: cst.CSTNode) -> set[str]:
    """Local names the rendered code reads that the old scope bound and the new one no longer does."""
    reads, binds = set(), set()
    for code in rendered:
        for node in ast.walk(ast.parse(textwrap.dedent(code))):
            if isinstance(node, ast.Name):
                (reads if isinstance(node.ctx, ast.Load) else binds).add(node.id)
    return (reads - binds) & (_locals(old_scope) - _locals(new_scope)) if old_scope is not None else set()


# ---- the whole migration --------------------------------------------------------------------------------------


def _read(spec: Spec, source: UpstreamSource, cache: dict) -> tuple[UnitSource, ...]:
    """`generate.read_units`, each upstream module parsed once per migration (parsed modules are immutable)."""
    read = []
    for unit in spec_units(spec):
        key = (id(source), unit.module)
        if key not in cache:
            cache[key] = read_unit(unit, source)
        read.append(dataclasses.replace(cache[key], unit=unit))
    return with_patches(spec, read)


@dataclass
class _Proposal:
    model: str
    status: PatchStatus
    edits: list[SpecEdit]
    reason: str
    mine: bool  # the spec's own table (not inherited): it defines the edit others must agree with
    rename: Callable[[str], str] = lambda text: text  # the stating file's class names -> this spec's (class_prefix)


def _proposals(
    upgrade: Upgrade, old_source: UpstreamSource, new_source: UpstreamSource, cache: dict
) -> list[_Proposal]:
    out = []
    for model in upgrade.models:
        failing = {s.patch.index: s for s in model.patches if not s.applies}
        if not failing:
            continue
        if model.problem:
            out += [_Proposal(model.spec.name, s, [], model.problem, True) for s in failing.values()]
            continue
        news = _read(model.spec, new_source, cache)
        try:
            olds = {u.unit.name: u for u in _read(model.spec, old_source, cache)}
        except PatchgenError:
            olds = {}
        for new in news:
            for error in resolve_each(new.module, new.patches)[1]:
                status = failing[error.patch.index]
                found = propose(error, new, olds.get(new.unit.name))
                where = origin(model.spec.path, error.patch.index)
                if isinstance(found, str) or where is None:
                    reason = found if isinstance(found, str) else "the patch is implied by [model], not written"
                    out.append(_Proposal(model.spec.name, status, [], reason, True))
                    continue
                path, table, rename = where
                raw = tomllib.loads(path.read_text(encoding="utf-8"))["patch"][table - 1]
                edits = []
                for key, value in found[0].items():
                    old = raw.get("vars", {}).get(key[5:]) if key.startswith("vars.") else raw.get(key)
                    edits.append(SpecEdit(path, table, key, old, value))
                out.append(_Proposal(model.spec.name, status, edits, found[1], path == model.spec.path, rename))
    return out


def _agree(proposals: list[_Proposal]) -> None:
    """An inherited patch is migrated only through its base spec: the base must propose the same edit (its class
    names renamed as the derived spec renames them); otherwise the derived patch is left to the human."""
    owned = {(e.path, e.table, e.key): e for p in proposals if p.mine for e in p.edits}
    for p in proposals:
        if p.mine or not p.edits:
            continue
        base = [owned.get((e.path, e.table, e.key)) for e in p.edits]
        if any(b is None or p.rename(b.new) != e.new for b, e in zip(base, p.edits, strict=True)):
            p.reason = f"inherited from {p.edits[0].path.name}, where the same edit is not proposed: {p.reason}"
            p.edits = []
        else:
            p.edits = list(base)


def _files(proposals: list[_Proposal]) -> dict[Path, str]:
    """The edited texts; the proposals of a file that cannot be edited in place are left to the human."""
    texts = {}
    by_path: dict[Path, list[SpecEdit]] = {}
    for p in proposals:
        for edit in p.edits:
            if edit not in by_path.setdefault(edit.path, []):
                by_path[edit.path].append(edit)
    for path, edits in by_path.items():
        try:
            texts[path] = edited_text(path.read_text(encoding="utf-8"), edits)
        except (ValueError, KeyError, IndexError, tomllib.TOMLDecodeError) as exc:
            for p in proposals:
                if any(e.path == path for e in p.edits):
                    p.reason, p.edits = f"cannot edit {path.name} in place: {exc}", []
    return texts


def _load_migrated(config: ProjectConfig, texts: dict[Path, str], scratch: Path, spec: Spec) -> Spec:
    for path in config.specs_dir.glob("*.toml"):
        (scratch / path.name).write_text(texts.get(path, path.read_text(encoding="utf-8")), encoding="utf-8")
    return load_spec(scratch / spec.path.name, config.templates_dir)


def _check(
    config: ProjectConfig,
    upgrade: Upgrade,
    proposals: list[_Proposal],
    old_source: UpstreamSource,
    new_source: UpstreamSource,
    scratch: Path,
    cache: dict,
) -> dict[str, tuple[int, int]] | None:
    """Load every spec an edited file reaches and resolve it against the new release. An edit is refused when the
    patch of its table (in any spec that states or inherits it) does not apply, or its rendered code reads a local
    name the old scope bound and the new one does not; then every proposal sharing it is left, and None returned.
    Otherwise: (patches applying, patches) per model, with the migrated specs."""
    texts = _files(proposals)
    edited = [e for p in proposals for e in p.edits]
    counts, bad = {}, {}
    for model in upgrade.models:
        counts[model.spec.name] = (sum(s.applies for s in model.patches), len(model.patches))
        if not {model.spec.path, *model.spec.extends} & set(texts):
            continue
        mine = [e for e in edited if e.path in (model.spec.path, *model.spec.extends)]
        try:
            spec = _load_migrated(config, texts, scratch, model.spec)
            news = _read(spec, new_source, cache)
            olds = {u.unit.name: u for u in _read(model.spec, old_source, cache)}
        except PatchgenError as exc:
            bad.update({e: f"the migrated {model.spec.name} spec does not load: {exc}" for e in mine})
            continue
        failing = set()
        for new in news:
            plan, errors = resolve_each(new.module, new.patches)
            failed = {e.patch.index: e for e in errors}
            failing |= set(failed)
            for patch in new.patches:
                where = origin(model.spec.path, patch.index)
                these = [e for e in mine if where is not None and (e.path, e.table) == where[:2]]
                if not these:
                    continue
                if patch.index in failed:
                    message = failed[patch.index].message.splitlines()[0]
                    why = f"after the edit {model.spec.name} #{patch.index} does not apply: {message}"
                    bad.update({e: why for e in these})
                    continue
                before = next(p for p in model.spec.patches if p.index == patch.index)
                old_unit = olds.get(new.unit.name)
                try:
                    old_scope = find_scope(old_unit.module, before.scope) if old_unit else None
                except LocateError:
                    old_scope = None
                try:
                    new_scope = find_scope(new.module, patch.scope)
                    gone = dangling(plan.rendered_by.get(patch.index, []), old_scope, new_scope)
                except SyntaxError:
                    gone = {"(its rendered code does not parse alone)"}
                if gone:
                    names = ", ".join(sorted(gone))
                    bad.update(
                        {
                            e: f"the template reads {names}, which the old scope bound and the new one does not"
                            for e in these
                        }
                    )
        counts[model.spec.name] = (len(spec.patches) - len(failing), len(spec.patches))
    for p in proposals:
        why = next((bad[e] for e in p.edits if e in bad), None)
        if why is not None:
            p.reason, p.edits = why + f" (proposed: {p.reason})", []
    return None if bad else counts


def migrate(
    config: ProjectConfig, upgrade: Upgrade, old_source: UpstreamSource, new_source: UpstreamSource
) -> Migration:
    """Propose, check and count: the migrated specs, re-resolved against the new release, give `after`."""
    cache: dict = {}
    proposals = _proposals(upgrade, old_source, new_source, cache)
    _agree(proposals)
    (config.root / REVIEW_DIR).mkdir(exist_ok=True)  # the scratch specs sit in the project: headers name them
    scratch = Path(tempfile.mkdtemp(dir=config.root / REVIEW_DIR, prefix=".migrate-"))
    try:
        counts = None
        while counts is None:  # each round leaves at least one proposal, or accepts them all
            counts = _check(config, upgrade, proposals, old_source, new_source, scratch, cache)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    texts = _files(proposals)
    outcomes = tuple(Outcome(p.model, p.status, tuple(p.edits), p.reason) for p in proposals)
    statuses = [s for m in upgrade.models for s in m.patches]
    before = (sum(s.applies for s in statuses), len(statuses))
    after = (sum(a for a, _ in counts.values()), sum(n for _, n in counts.values()))
    return Migration(outcomes, texts, spec_diff(config, texts), before, after)


def spec_diff(config: ProjectConfig, texts: dict[Path, str]) -> str:
    out = []
    for path, text in sorted(texts.items()):
        rel = path.relative_to(config.root).as_posix()
        lines = difflib.unified_diff(
            path.read_text(encoding="utf-8").splitlines(keepends=True),
            text.splitlines(keepends=True),
            fromfile=f"a/{rel}",
            tofile=f"b/{rel}",
        )
        out += [line if line.endswith("\n") else line + "\n" for line in lines]
    return "".join(out)


def apply_specs(migration: Migration) -> list[Path]:
    """Write the migrated spec files, all or none: each new text is staged beside its file first, then the staged
    files are renamed over theirs (a failure while staging changes nothing). Every text was loaded and resolved."""
    staged: list[tuple[Path, Path]] = []
    try:
        for path, text in sorted(migration.texts.items()):
            staged.append((path.with_name(f".{path.name}.patchgen-tmp"), path))
            staged[-1][0].write_text(text, encoding="utf-8", newline="")
    except OSError as exc:
        for temp, _ in staged:
            temp.unlink(missing_ok=True)
        raise PatchgenError(f"cannot write {staged[-1][1]}: {exc.strerror}; no spec file was changed") from exc
    for temp, path in staged:
        os.replace(temp, path)
    return [path for _, path in staged]


def _cell(text: str | None) -> str:
    return "" if text is None else "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def markdown(migration: Migration, pin: str) -> str:
    """The report's migration section (deterministic: no times, paths relative to the project)."""
    (done, total), (after, _) = migration.before, migration.after
    moved = [o for o in migration.outcomes if o.edits]
    left = [o for o in migration.outcomes if not o.edits]
    out = [
        "## Migration (`--migrate`)",
        "",
        f"**Patches applying: {done} of {total} with the pinned specs; {after} of {total} with the migrated specs** "
        f"(re-resolved against {pin}). {len(moved)} patch(es) migrated, {len(left)} left to a human. The edits are "
        f"`specs.diff` in the review directory; specs/ changes only with `--apply-specs`.",
        "",
    ]
    if moved:
        out += [
            "### Proposed edits",
            "",
            "| model | patch | file | key | was | becomes | reason |",
            "|---|---|---|---|---|---|---|",
        ]
        for o in moved:
            for e in o.edits:
                out.append(
                    f"| {o.model} | #{o.status.patch.index} {o.status.patch.template.name} | {e.path.name} "
                    f"[[patch]] {e.table} | {e.key} | {_cell(e.old)} | {_cell(e.new)} | {o.reason} |"
                )
        out.append("")
    if left:
        out += [
            "### Left to a human",
            "",
            "| model | patch | status | why not | report's candidates |",
            "|---|---|---|---|---|",
        ]
        for o in left:
            cands = "; ".join(f"line {n}: {_cell(t)}" for n, t in o.status.candidates) or "-"
            out.append(
                f"| {o.model} | #{o.status.patch.index} {o.status.patch.template.name} | {o.status.status} | "
                f"{o.reason.replace('|', chr(92) + '|')} | {cands} |"
            )
        out.append("")
    return "\n".join(out)
