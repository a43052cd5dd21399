"""The pipeline: spec + templates + pinned upstream source -> generated module text and its review diff.

A spec with companions (`patchgen.units`) generates one file per unit: every upstream module is read and parsed, each
patch assigned to the unit whose module defines its scope, every unit resolved before any is built; the companions'
redefinitions decide which imports each file re-points, and the set is checked for upstream code that would still
run an upstream definition a companion redefines.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import symtable
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import libcst as cst
from libcst.helpers import get_absolute_module_for_import, get_full_name_for_node
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

from patchgen import __version__
from patchgen.config import ProjectConfig
from patchgen.cst.locate import ANCHOR_MOVED, SCOPE_MISSING, code_of
from patchgen.cst.names import check_identifier_vars
from patchgen.cst.plan import RENDER_ERROR, Plan, PlanError, resolve
from patchgen.cst.prune import DanglingReference, check_dangling, companion_layout, parsed, prune
from patchgen.cst.removals import check_removals
from patchgen.cst.scopes import scopes_matching
from patchgen.cst.transform import PatchTransformer, insert_imports
from patchgen.errors import PatchgenError
from patchgen.header import Header, body_hash
from patchgen.ops.exclude import check_roots, kept_definitions
from patchgen.ops.rename import Rename
from patchgen.provenance import engine_sha256, templates_sha256, unified_diff
from patchgen.spec import Patch, Spec
from patchgen.spec_sites import check_processor_sites
from patchgen.units import Redefined, Unit, assign, check_links, companion_imports, redefined, units
from patchgen.upstream import UpstreamFile, UpstreamSource

T = TypeVar("T")


@dataclass(frozen=True)
class Generated:
    """One generated file; the spec's main file also holds its companions' files."""

    spec: Spec
    upstream: UpstreamFile
    relpath: str  # output path relative to the project root
    text: str
    diff: str
    header: Header
    companions: tuple[Generated, ...] = ()

    @property
    def diff_relpath(self) -> str:
        return self.relpath + ".diff"

    @property
    def files(self) -> tuple[Generated, ...]:
        """The main file, then each companion's."""
        return (self, *self.companions)


@dataclass(frozen=True)
class UnitSource:
    """One unit of a spec with its upstream file, parsed, and the patches that edit it."""

    unit: Unit
    upstream: UpstreamFile
    module: cst.Module
    patches: tuple[Patch, ...]


def upstream_lines(module: cst.Module, nodes: list[cst.CSTNode]) -> list[int]:
    """1-based upstream line of each node (computed only when a message or `explain` needs it)."""
    positions = _positions(module)
    return [positions[n].start.line if n in positions else 0 for n in nodes]


@functools.lru_cache(maxsize=8)
def _positions(module: cst.Module) -> Mapping[cst.CSTNode, CodeRange]:
    """Positions of a whole module cost about a second for a big file: an upgrade that reports many patches of
    one module computes them once (modules hash by identity)."""
    return MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)


def candidate_lines(module: cst.Module, exc: PlanError) -> list[tuple[int, str]]:
    """(upstream line, first line of its text) of each of the error's nearest candidates."""
    numbers = upstream_lines(module, [node for _, node in exc.candidates]) if exc.candidates else []
    return [(no, text.splitlines()[0] if text else "") for no, (text, _) in zip(numbers, exc.candidates, strict=True)]


def other_scopes(module: cst.Module, exc: PlanError) -> list[tuple[str, int]]:
    """(scope, upstream line) of each function or method, other than the patch's, where its anchor matches."""
    patch = exc.patch
    if exc.kind not in (ANCHOR_MOVED, SCOPE_MISSING) or not patch.anchor_text:
        return []
    expression = getattr(patch.template, "op", None) == "wrap"
    try:
        found = [(s, n) for s, n in scopes_matching(module, patch.anchor_text, expression) if s != patch.scope]
    except (cst.ParserSyntaxError, RecursionError):
        return []
    lines = upstream_lines(module, [node for _, node in found])
    return [(scope, line) for (scope, _), line in zip(found, lines, strict=True)]


def imported_from(module: cst.Module, module_name: str, name: str) -> str | None:
    """The module a top-level `from x import name` of `module` names, absolute; None when it imports no such name."""
    for stmt in module.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
                if any(
                    (a.asname.name.value if a.asname else get_full_name_for_node(a.name)) == name for a in small.names
                ):
                    return get_absolute_module_for_import(module_name, small)
    return None


def plan_error(spec: Spec, upstream: UpstreamFile, module: cst.Module, exc: PlanError) -> PatchgenError:
    lines = [f"{spec.path}: {exc.patch.label} in scope {exc.patch.where!r}: {exc.message}"]
    if exc.candidates:
        lines.append(f"  nearest candidates in {upstream.pin} {upstream.relpath}:")
        lines += [f"    line {no}: {text}" for no, text in candidate_lines(module, exc)]
    for scope, line in other_scopes(module, exc):
        lines.append(f"  the anchor matches in another scope: {scope} (line {line}); is 'scope' right?")
    top = exc.patch.scope.split(".")[0]
    elsewhere = imported_from(module, upstream.module, top) if exc.kind == SCOPE_MISSING else None
    if exc.kind == RENDER_ERROR:
        hint = "fix the template or the patch's vars, then run `patchgen regen` again"
    elif elsewhere is not None and elsewhere.split(".")[0] == spec.package:
        hint = (
            f"{top} is defined in {elsewhere}, which {upstream.module} imports it from: to patch it, declare "
            f'[[companion]] module = "{elsewhere}", keep = ["{top}"] in the spec (see docs/spec-reference.md)'
        )
    else:
        hint = "fix the spec's anchor/scope (copy the statement from upstream), then run `patchgen regen` again"
    if len(lines) == 1 and "\n" not in lines[0]:  # nothing to list: one line
        return PatchgenError(f"{lines[0]}; {hint}")
    return PatchgenError("\n".join([*lines, "  " + hint]))


def parse_upstream(upstream: UpstreamFile) -> cst.Module:
    try:
        return _parse(upstream.text)
    except cst.ParserSyntaxError as exc:
        raise PatchgenError(f"{upstream.relpath} ({upstream.pin}): libcst cannot parse it: {exc}") from exc


@functools.lru_cache(maxsize=8)
def _parse(text: str) -> cst.Module:
    """One parse per upstream text in a run: a shared module (diffusers' attention_processor.py, 5.7k lines, a
    companion of several DiT specs) is parsed, and its positions resolved, once for all of them. Sharing is safe:
    libcst trees are immutable, and each spec's plan and rewrite make new trees."""
    return cst.parse_module(text)


def plan_unit(spec: Spec, source: UnitSource) -> Plan:
    try:
        return resolve(source.module, source.patches)
    except PlanError as exc:
        raise plan_error(spec, source.upstream, source.module, exc) from exc


def read_unit(unit: Unit, source: UpstreamSource) -> UnitSource:
    """A unit's upstream module, read and parsed (its patches are assigned by `with_patches`)."""
    upstream = source.read(unit.module)
    return UnitSource(unit, upstream, parse_upstream(upstream), ())


def with_patches(spec: Spec, read: list[UnitSource]) -> tuple[UnitSource, ...]:
    """The units with the patches that edit each (`patchgen.units.assign`)."""
    defined = {
        s.unit.name: {d.name.value for d in s.module.body if isinstance(d, cst.ClassDef | cst.FunctionDef)}
        for s in read
    }
    patches = assign(spec, tuple(s.unit for s in read), defined)
    return tuple(dataclasses.replace(s, patches=patches[s.unit.name]) for s in read)


def read_units(spec: Spec, source: UpstreamSource) -> tuple[UnitSource, ...]:
    """Every upstream module of the spec, read and parsed, with the patches that edit it."""
    return with_patches(spec, [read_unit(unit, source) for unit in units(spec)])


def _within_limits(run: Callable[..., T]) -> Callable[..., T]:
    """Input that exhausts the engine (nesting past Python's recursion limit or past what `ast` parses, though
    libcst took it) is a user error naming the spec, not a traceback."""

    @functools.wraps(run)
    def guarded(spec: Spec, *args: Any, **kwargs: Any) -> T:
        try:
            return run(spec, *args, **kwargs)
        except RecursionError:
            raise PatchgenError(
                f"{spec.path}: code nested too deeply for patchgen (Python's recursion limit) while generating "
                f"{spec.output}; simplify the nesting of the upstream code or of the patches' rendered code"
            ) from None
        except SyntaxError as exc:
            where = exc.filename if exc.filename and exc.filename != "<unknown>" else "a patch's rendered code"
            raise PatchgenError(
                f"{spec.path}: {where}: not valid Python to this interpreter: {exc.msg} (line {exc.lineno})"
            ) from None

    return guarded


@_within_limits
def generate(spec: Spec, source: UpstreamSource, config: ProjectConfig) -> Generated:
    sources = read_units(spec, source)
    return build(spec, sources, [plan_unit(spec, s) for s in sources], config, source)


@_within_limits
def build(
    spec: Spec, sources: tuple[UnitSource, ...], plans: list[Plan], config: ProjectConfig, source: UpstreamSource
) -> Generated:
    """Every file of the spec (`plans` holds exactly each unit's patches), then the checks across them."""
    companions = redefined(
        (s.unit, plan.added_names) for s, plan in zip(sources, plans, strict=True) if s.unit.companion
    )
    files = [build_file(spec, s, plan, config, companions) for s, plan in zip(sources, plans, strict=True)]
    check_handles(spec, [code for plan in plans for codes in plan.rendered_by.values() for code in codes])
    check_processor_sites(spec)
    check_links(spec, [(f.relpath, f.text) for f in files], companions, source)
    return dataclasses.replace(files[0], companions=tuple(files[1:]))


def build_file(spec: Spec, source: UnitSource, plan: Plan, config: ProjectConfig, companions: Redefined) -> Generated:
    """Rewrite, prune, add the header and check one unit's file."""
    unit, upstream, module, patches = source.unit, source.upstream, source.module, source.patches
    check_roots(spec, unit, upstream, module)
    layout = None
    if unit.companion:
        anchored = {id(e.target) for e in plan.edits}
        layout = companion_layout(module, set(unit.keep), plan.rendered, anchored)
    transformer = PatchTransformer(plan, unit.module, companions, layout.dropped if layout else frozenset())
    try:
        patched = module.visit(transformer)
    except PlanError as exc:
        raise plan_error(spec, upstream, module, exc) from exc
    for patch in patches:
        count = transformer.applied.get(patch.index, 0)
        if count != 1:
            raise PatchgenError(f"{spec.path}: {patch.label}: applied {count} times, expected exactly once")
    check_removals(str(spec.path), plan, module, upstream.relpath, functools.partial(upstream_lines, module))
    if layout is not None and layout.imported:
        line = f"from {unit.module} import {', '.join(layout.imported)}"
        patched = insert_imports(patched, [line], "companion", "upstream definitions this module does not redefine")
    tree = functools.partial(parsed, upstream.text, f"{upstream.relpath} ({upstream.pin})")  # parsed when needed
    used = companion_imports(unit, patches, tree(), companions) if companions.by_module else []
    patched = insert_imports(patched, used, "companion classes", "the spec's copies, which the patches below name")
    patched = insert_imports(patched, plan.imports)
    if unit.companion:
        keep = {plan.renames.get(name, name) for name in unit.keep} | plan.added_names
    else:
        keep = kept_definitions(unit, upstream, plan)
    pruned, removed = prune(patched, keep)
    for patch in patches:  # an edit inside a pruned definition would be "applied" yet absent from the output
        top = plan.renames.get(patch.scope.split(".")[0], patch.scope.split(".")[0])
        if top in removed:
            raise PatchgenError(
                f"{spec.path}: {patch.label} edits {patch.scope}, but {top} is pruned: nothing "
                f"reachable from 'keep' uses it (upstream may build it indirectly, e.g. via "
                f"AutoModel). Add it to 'keep', or patch the code that builds it"
            )
    body = pruned.code
    if spec.model is not None and not unit.companion:
        check_model_class(spec, pruned, plan)
    relpath = unit.output
    header = Header(
        model=spec.name,
        upstream_pin=upstream.pin,
        upstream_path=upstream.relpath,
        upstream_sha256=upstream.sha256,
        spec_path=spec.path.relative_to(config.root).as_posix() if spec.path.is_absolute() else spec.path.as_posix(),
        spec_sha256=spec.sha256,
        templates_sha256=templates_sha256(spec),
        engine_version=__version__,
        engine_sha256=engine_sha256(),
        body_sha256=body_hash(body),
        patches=tuple(f"#{p.index} {p.template.name} @ {p.scope}: {p.why}" for p in patches),
    )
    text = header.render() + body
    try:
        compile(text, relpath, "exec", dont_inherit=True)
        table = symtable.symtable(text, relpath, "exec")
        check_dangling(table, removed)
    except SyntaxError as exc:
        raise PatchgenError(f"{spec.path}: generated code does not compile: {exc}") from exc
    except DanglingReference as exc:
        raise PatchgenError(
            f"{spec.path}: generated code refers to pruned or excluded names: {exc}; keep them "
            f"(add to 'keep'), stop excluding them, or patch the reference away"
        ) from exc
    check_identifier_vars(patches, plan, tree, table, str(spec.path), relpath)
    return Generated(spec, upstream, relpath, text, unified_diff(upstream, text, relpath), header)


def check_handles(spec: Spec, rendered: list[str]) -> None:
    """`[model] handles` is a claim that the patched code re-implements a config option upstream's removed code
    honoured; it is believed only when a patch's rendered code reads the option (`.<key>`) and a tiny config of the
    spec sets it, so that the suites and the self-check run the branch (a claim nothing reads trains wrong)."""
    if spec.model is None:
        return
    variants = (spec.model.data.get("tiny_variants") or {}).values()
    for key in spec.model.handles:
        read = re.compile(rf"\.{re.escape(key)}\b")
        if not any(read.search(code) for code in rendered):
            raise PatchgenError(
                f"{spec.path}: [model] handles {key!r}, but no patch's rendered code reads it (.{key}): a handled "
                f"option must be re-implemented by a patch (e.g. loss/causal_lm_head's softcap = "
                f'"self.config.{key}"); add that patch or drop the key from handles'
            )
        if all(tiny.get(key) is None for tiny in (spec.model.tiny, *variants)):
            raise PatchgenError(
                f"{spec.path}: [model] handles {key!r}, but neither [model.tiny] nor a data.tiny_variants table sets "
                f"it: set it in a tiny variant to a value where it changes the result, so that the suites run it"
            )


def check_model_class(spec: Spec, pruned: cst.Module, plan: Plan) -> None:
    """The class that trains the model is one the spec keeps on purpose: a `keep` root (as renamed) or a class a
    patch adds, never a helper that is only there because a root uses it."""
    kept = {plan.renames.get(name, name) for name in spec.keep} | set(plan.added_names)
    classes = {s.name.value for s in pruned.body if isinstance(s, cst.ClassDef)}
    if spec.model.cls not in kept & classes:
        roots = ", ".join(sorted(kept & classes)) or "none"
        raise PatchgenError(
            f"{spec.path}: [model] class {spec.model.cls!r} is not a kept class of the generated module: name a "
            f"'keep' root or a class a patch adds ({roots})"
        )


@dataclass(frozen=True)
class ExplainedPatch:
    index: int
    template: str
    op: str
    scope: str
    anchor: str | None
    upstream_line: int
    why: str
    rendered: str
    upstream_path: str = ""  # the companion's upstream file, when the patch edits a companion


@_within_limits
def explain(spec: Spec, source: UpstreamSource) -> tuple[UpstreamFile, list[ExplainedPatch]]:
    """Every patch of every unit, in spec order; the spec's main upstream file."""
    sources = read_units(spec, source)
    out = []
    for unit_source in sources:
        plan = plan_unit(spec, unit_source)
        lines = upstream_lines(unit_source.module, [e.target for e in plan.edits])
        for edit, line in zip(plan.edits, lines, strict=True):
            patch = edit.patch
            builtins = {"scope": patch.scope, "spec": patch.source, "patch": str(patch.index)}
            if "expr" in edit.op.builtins:
                builtins["expr"] = code_of(edit.target)
            rendered = edit.code if isinstance(edit.op, Rename) else patch.template.render(patch.vars, builtins)
            out.append(
                ExplainedPatch(
                    patch.index,
                    patch.template.name,
                    patch.template.op,
                    f"{unit_source.unit.name}:{patch.scope}" if unit_source.unit.companion else patch.scope,
                    patch.anchor_text,
                    line,
                    patch.why,
                    rendered.rstrip("\n"),
                    "" if not unit_source.unit.companion else unit_source.upstream.relpath,
                )
            )
    return sources[0].upstream, sorted(out, key=lambda p: p.index)
