"""The pipeline: spec + templates + pinned upstream source -> generated module text and its review diff."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

from patchgen import __version__
from patchgen.config import ProjectConfig
from patchgen.cst.locate import ANCHOR_MOVED, SCOPE_MISSING, code_of, scopes_matching
from patchgen.cst.plan import RENDER_ERROR, Plan, PlanError, resolve
from patchgen.cst.prune import DanglingReference, check_dangling, prune
from patchgen.cst.transform import PatchTransformer, insert_imports
from patchgen.errors import PatchgenError
from patchgen.header import Header, body_hash
from patchgen.ops.exclude import check_roots, kept_definitions
from patchgen.ops.rename import Rename
from patchgen.provenance import engine_sha256, templates_sha256, unified_diff
from patchgen.spec import Spec
from patchgen.upstream import UpstreamFile, UpstreamSource

T = TypeVar("T")


@dataclass(frozen=True)
class Generated:
    spec: Spec
    upstream: UpstreamFile
    relpath: str  # output path relative to the project root
    text: str
    diff: str
    header: Header

    @property
    def diff_relpath(self) -> str:
        return self.relpath + ".diff"


def upstream_lines(module: cst.Module, nodes: list[cst.CSTNode]) -> list[int]:
    """1-based upstream line of each node (computed only when a message or `explain` needs it)."""
    positions = _positions(module)
    return [positions[n].start.line if n in positions else 0 for n in nodes]


@functools.lru_cache(maxsize=4)
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


def plan_error(spec: Spec, upstream: UpstreamFile, module: cst.Module, exc: PlanError) -> PatchgenError:
    lines = [f"{spec.path}: {exc.patch.label} in scope {exc.patch.scope!r}: {exc.message}"]
    if exc.candidates:
        lines.append(f"  nearest candidates in {upstream.pin} {upstream.relpath}:")
        lines += [f"    line {no}: {text}" for no, text in candidate_lines(module, exc)]
    for scope, line in other_scopes(module, exc):
        lines.append(f"  the anchor matches in another scope: {scope} (line {line}); is 'scope' right?")
    if exc.kind == RENDER_ERROR:
        hint = "fix the template or the patch's vars, then run `patchgen regen` again"
    else:
        hint = "fix the spec's anchor/scope (copy the statement from upstream), then run `patchgen regen` again"
    if len(lines) == 1 and "\n" not in lines[0]:  # nothing to list: one line
        return PatchgenError(f"{lines[0]}; {hint}")
    return PatchgenError("\n".join([*lines, "  " + hint]))


def parse_upstream(upstream: UpstreamFile) -> cst.Module:
    try:
        return cst.parse_module(upstream.text)
    except cst.ParserSyntaxError as exc:
        raise PatchgenError(f"{upstream.relpath} ({upstream.pin}): libcst cannot parse it: {exc}") from exc


def plan_spec(spec: Spec, upstream: UpstreamFile, module: cst.Module) -> Plan:
    try:
        return resolve(module, spec.patches)
    except PlanError as exc:
        raise plan_error(spec, upstream, module, exc) from exc


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
    upstream = source.read(spec.module)
    module = parse_upstream(upstream)
    return build(spec, upstream, module, plan_spec(spec, upstream, module), config)


@_within_limits
def build(spec: Spec, upstream: UpstreamFile, module: cst.Module, plan: Plan, config: ProjectConfig) -> Generated:
    """Rewrite, prune, add the header and check the result; `plan` must hold exactly the patches of `spec`."""
    check_roots(spec, upstream, module)

    transformer = PatchTransformer(plan, spec.module)
    try:
        patched = module.visit(transformer)
    except PlanError as exc:
        raise plan_error(spec, upstream, module, exc) from exc
    for patch in spec.patches:
        count = transformer.applied.get(patch.index, 0)
        if count != 1:
            raise PatchgenError(f"{spec.path}: {patch.label}: applied {count} times, expected exactly once")
    patched = insert_imports(patched, plan.imports)
    pruned, removed = prune(patched, kept_definitions(spec, upstream, plan))
    for patch in spec.patches:  # an edit inside a pruned definition would be "applied" yet absent from the output
        top = plan.renames.get(patch.scope.split(".")[0], patch.scope.split(".")[0])
        if top in removed:
            raise PatchgenError(
                f"{spec.path}: {patch.label} edits {patch.scope}, but {top} is pruned: nothing "
                f"reachable from 'keep' uses it (upstream may build it indirectly, e.g. via "
                f"AutoModel). Add it to 'keep', or patch the code that builds it"
            )
    body = pruned.code
    if spec.model is not None:
        check_model_class(spec, pruned, plan)
    relpath = spec.output
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
        patches=tuple(f"#{p.index} {p.template.name} @ {p.scope}: {p.why}" for p in spec.patches),
    )
    text = header.render() + body
    try:
        compile(text, relpath, "exec", dont_inherit=True)
        check_dangling(text, removed, relpath)
    except SyntaxError as exc:
        raise PatchgenError(f"{spec.path}: generated code does not compile: {exc}") from exc
    except DanglingReference as exc:
        raise PatchgenError(
            f"{spec.path}: generated code refers to pruned or excluded names: {exc}; keep them "
            f"(add to 'keep'), stop excluding them, or patch the reference away"
        ) from exc

    return Generated(spec, upstream, relpath, text, unified_diff(upstream, text, relpath), header)


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


@_within_limits
def explain(spec: Spec, source: UpstreamSource) -> tuple[UpstreamFile, list[ExplainedPatch]]:
    upstream = source.read(spec.module)
    module = parse_upstream(upstream)
    plan = plan_spec(spec, upstream, module)
    lines = upstream_lines(module, [e.target for e in plan.edits])
    out = []
    for edit, line in zip(plan.edits, lines, strict=True):
        patch = edit.patch
        builtins = {"scope": patch.scope}
        if "expr" in edit.op.builtins:
            builtins["expr"] = code_of(edit.target)
        rendered = edit.code if isinstance(edit.op, Rename) else patch.template.render(patch.vars, builtins)
        out.append(
            ExplainedPatch(
                patch.index,
                patch.template.name,
                patch.template.op,
                patch.scope,
                patch.anchor_text,
                line,
                patch.why,
                rendered.rstrip("\n"),
            )
        )
    return upstream, out
