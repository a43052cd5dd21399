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
import dataclasses
import difflib
import os
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
    LocateError,
    code_of,
)
from patchgen.cst.plan import resolve_each
from patchgen.cst.scopes import find_scope
from patchgen.errors import PatchgenError
from patchgen.files import stage_beside
from patchgen.generate import UnitSource, read_unit, with_patches
from patchgen.migrate_rules import propose
from patchgen.spec import Spec, load_spec
from patchgen.spec_edits import SpecEdit, edited_text, origin
from patchgen.units import units as spec_units
from patchgen.upgrade import Upgrade
from patchgen.upgrade_review import REVIEW_DIR
from patchgen.upgrade_status import PatchStatus
from patchgen.upstream import UpstreamSource


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


def onto_specs(migration: Migration, config: ProjectConfig, run_specs: Path, replaced: dict[Path, str]) -> Migration:
    """A migration made from a `--with-specs` copy (`run_specs`) restated against specs/: every text by its specs/
    path, the replaced files included (migrated further where the rules edited them), and the diff from specs/. So
    `specs.diff`, `--apply-specs` and `--verify` carry the reviewed files and the rules' edits together."""
    texts = dict(replaced)
    texts.update({config.specs_dir / path.relative_to(run_specs): text for path, text in migration.texts.items()})
    return dataclasses.replace(migration, texts=texts, diff=spec_diff(config, texts))


def apply_specs(migration: Migration) -> list[Path]:
    """Write the migrated spec files, all or none: each new text is staged beside its file first, then the staged
    files are renamed over theirs (a failure while staging changes nothing). Every text was loaded and resolved."""
    staged: list[tuple[Path, Path]] = []
    for path, text in sorted(migration.texts.items()):
        try:  # a fresh name, created exclusively: nothing planted beside the spec is followed
            staged.append((stage_beside(path, text.encode("utf-8")), path))
        except OSError as exc:
            for temp, _ in staged:
                temp.unlink(missing_ok=True)
            raise PatchgenError(f"cannot write {path}: {exc.strerror}; no spec file was changed") from exc
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
