"""Resolve every patch of a spec to the upstream node it edits, before anything is edited.

Resolving first means errors name upstream lines, a patch can never anchor on code another patch wrote,
and the rewrite itself is a single pass keyed by node identity. Each patch resolves on its own, so
`resolve_each` can report every patch that does not apply (`patchgen upgrade`) where `resolve` stops at the first.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import libcst as cst

from patchgen.cst.locate import (
    ANCHOR_AMBIGUOUS,
    ANCHOR_MOVED,
    INVALID_ANCHOR,
    SCOPE_AMBIGUOUS,
    SCOPE_MISSING,
    LocateError,
    NodeIndex,
    code_of,
    find_expression,
    find_statement,
    find_statement_range,
    scope_chain,
)
from patchgen.errors import PatchgenError
from patchgen.spec import Patch

# PlanError.kind, besides the LocateError kinds: why a patch does not apply (the upgrade report's status column).
CONFLICT = "conflict"  # it edits code another patch replaces, or adds a method upstream now defines
SCOPE_MISMATCH = "scope mismatch"  # the scope is not the kind of definition the op needs (e.g. a class)
RENDER_ERROR = "render error"  # the template does not render, or renders invalid Python
SPEC_ERROR = "spec error"  # the patch's keys do not fit its op, whatever upstream says
KINDS = (
    SCOPE_MISSING,
    SCOPE_AMBIGUOUS,
    ANCHOR_MOVED,
    ANCHOR_AMBIGUOUS,
    INVALID_ANCHOR,
    CONFLICT,
    SCOPE_MISMATCH,
    RENDER_ERROR,
    SPEC_ERROR,
)


@dataclass(frozen=True)
class Edit:
    patch: Patch
    kind: str  # before | after | replace | wrap | add_members | replace_def | append_module | rename
    target: cst.CSTNode
    code: str  # rendered template body ("" for wrap, rendered per use; new name for rename)
    span: tuple[cst.CSTNode, ...] = ()  # replace with `through`: the further statements the replacement removes


@dataclass
class Plan:
    edits: list[Edit] = field(default_factory=list)
    imports: list[str] = field(default_factory=list)
    renames: dict[str, str] = field(default_factory=dict)
    added_names: set[str] = field(default_factory=set)
    rendered: list[str] = field(default_factory=list)  # every rendered body: its references keep definitions alive
    chain_ids: set[int] = field(default_factory=set)  # definitions on the way down to a scope: visit them
    path_ids: set[int] = field(default_factory=set)  # edited nodes and their ancestors: the rewrite visits these

    def absorb(self, part: Plan) -> None:
        """Add one patch's resolution (resolved into its own Plan) to this one."""
        self.edits += part.edits
        self.imports += [line for line in part.imports if line not in self.imports]
        self.renames.update(part.renames)
        self.added_names |= part.added_names
        self.rendered += part.rendered
        self.chain_ids |= part.chain_ids
        self.path_ids |= part.path_ids

    def by_target(self) -> dict[int, list[Edit]]:
        table: dict[int, list[Edit]] = {}
        for edit in self.edits:
            table.setdefault(id(edit.target), []).append(edit)
        return table


class PlanError(Exception):
    """A patch that does not apply; `kind` (one of KINDS) says why, `candidates` are the nearest upstream matches."""

    def __init__(
        self,
        patch: Patch,
        message: str,
        candidates: list[tuple[str, cst.CSTNode]] | None = None,
        kind: str = SPEC_ERROR,
    ) -> None:
        super().__init__(message)
        self.patch = patch
        self.message = message
        self.candidates = candidates or []
        self.kind = kind


def parse_statements(code: str, patch: Patch) -> list[cst.BaseStatement]:
    try:
        module = cst.parse_module(textwrap.dedent(code))
    except cst.ParserSyntaxError as exc:
        raise PlanError(
            patch, f"rendered template is not valid Python: {exc}\n--- rendered ---\n{code}", kind=RENDER_ERROR
        ) from exc
    body = list(module.body)
    if not body:
        raise PlanError(patch, "rendered template is empty", kind=RENDER_ERROR)
    header = list(module.header)  # comments above the first statement belong to it, not to a "file header"
    while header and header[0].comment is None:
        header.pop(0)
    return [body[0].with_changes(leading_lines=[*header, *body[0].leading_lines]), *body[1:]]


def _defined_names(statements: list[cst.BaseStatement]) -> list[str]:
    return [s.name.value for s in statements if isinstance(s, cst.ClassDef | cst.FunctionDef)]


def resolve(module: cst.Module, patches: tuple[Patch, ...]) -> Plan:
    """The plan of every patch; raises the first PlanError (in patch order; conflicts after the rest)."""
    plan, errors = resolve_each(module, patches)
    if errors:
        raise errors[0]
    return plan


def resolve_each(module: cst.Module, patches: tuple[Patch, ...]) -> tuple[Plan, list[PlanError]]:
    """Resolve every patch independently: the plan of the patches that apply, and one error per patch that does
    not (resolution failures in patch order, then conflicts). A failing patch leaves no trace in the plan."""
    index = NodeIndex()
    parts: dict[int, Plan] = {}
    errors: list[PlanError] = []
    for patch in patches:
        try:
            parts[patch.index] = _resolve_one(module, patch, index)
        except LocateError as exc:
            errors.append(PlanError(patch, exc.message, exc.candidates, exc.kind))
        except PlanError as exc:
            errors.append(exc)
    errors += _conflicts([edit for part in parts.values() for edit in part.edits])
    failed = {error.patch.index for error in errors}
    plan = Plan()
    for patch in patches:
        if patch.index not in failed:
            plan.absorb(parts[patch.index])
    return plan, errors


def _resolve_one(module: cst.Module, patch: Patch, index: NodeIndex) -> Plan:
    """One patch's edits, rendered code and imports, as a plan of its own."""
    plan = Plan(imports=list(dict.fromkeys(patch.template.imports)))
    _resolve_into(module, patch, plan, index)
    scope = module if patch.template.op == "add_definition" else scope_chain(module, patch.scope)[-1]
    for edit in plan.edits:
        for node in (edit.target, *edit.span):
            plan.path_ids.update(id(n) for n in index.path(scope, node))
    return plan


def _resolve_into(module: cst.Module, patch: Patch, plan: Plan, index: NodeIndex) -> None:
    op = patch.template.op

    def render(values: dict) -> str:
        try:
            code = patch.template.render(values)
        except PatchgenError as exc:
            raise PlanError(patch, str(exc), kind=RENDER_ERROR) from exc
        plan.rendered.append(code)
        return code

    if op == "add_definition":
        if patch.scope != "<module>":
            raise PlanError(patch, f"op add_definition takes scope '<module>', found {patch.scope!r}")
        code = render({**patch.vars, "scope": patch.scope})
        plan.added_names.update(_defined_names(parse_statements(code, patch)))
        if patch.anchor_text is None:
            plan.edits.append(Edit(patch, "append_module", module, code))
        else:
            target = find_statement(module, patch.anchor_text, patch.scope, index)
            plan.edits.append(Edit(patch, "before" if patch.before else "after", target, code))
        return
    chain = scope_chain(module, patch.scope)
    scope = chain[-1]
    plan.chain_ids.update(id(n) for n in chain)
    variables = {**patch.vars, "scope": patch.scope}
    if op == "insert":
        target = find_statement(scope, patch.anchor_text, patch.scope, index)
        code = render(variables)
        parse_statements(code, patch)  # invalid code is this patch's error now, not the rewrite's later
        plan.edits.append(Edit(patch, "before" if patch.before else "after", target, code))
    elif op == "replace":
        if patch.through is None:
            run = [find_statement(scope, patch.anchor, patch.scope, index)]
        else:
            run = find_statement_range(scope, patch.anchor, patch.through, patch.scope, index)
        code = render(variables)
        parse_statements(code, patch)
        plan.edits.append(Edit(patch, "replace", run[0], code, tuple(run[1:])))
    elif op == "wrap":
        target = find_expression(scope, patch.anchor, patch.scope, index)
        code = render({**variables, "expr": code_of(target)})  # validate now; re-rendered on the final tree
        try:
            cst.parse_expression(code.strip())
        except cst.ParserSyntaxError as exc:
            raise PlanError(
                patch, f"rendered wrap is not a Python expression: {code.strip()!r}", kind=RENDER_ERROR
            ) from exc
        plan.edits.append(Edit(patch, "wrap", target, ""))
    elif op == "add_method":
        if not isinstance(scope, cst.ClassDef):
            raise PlanError(
                patch, f"op add_method needs a class scope, {patch.scope!r} is not a class", kind=SCOPE_MISMATCH
            )
        code = render(variables)
        existing = {s.name.value for s in scope.body.body if isinstance(s, cst.FunctionDef)}
        clash = sorted(existing & set(_defined_names(parse_statements(code, patch))))
        if clash:
            raise PlanError(
                patch, f"{patch.scope} already defines {clash}; use a replace_method template instead", kind=CONFLICT
            )
        plan.edits.append(Edit(patch, "add_members", scope, code))
    elif op in ("replace_method", "replace_definition"):
        want_method = op == "replace_method"
        if want_method != ("." in patch.scope) or not isinstance(scope, cst.FunctionDef | cst.ClassDef):
            shape = "'Class.method'" if want_method else "a top-level class or function name"
            kind = SPEC_ERROR if want_method != ("." in patch.scope) else SCOPE_MISMATCH
            raise PlanError(patch, f"op {op} takes scope {shape}, found {patch.scope!r}", kind=kind)
        code = render(variables)
        parse_statements(code, patch)
        plan.edits.append(Edit(patch, "replace_def", scope, code))
    elif op == "rename":
        if "." in patch.scope or "to" not in patch.vars:
            raise PlanError(patch, "op rename takes a top-level definition as scope and the new name as vars.to")
        plan.renames[patch.scope] = patch.vars["to"]
        plan.edits.append(Edit(patch, "rename", scope, patch.vars["to"]))
    if op in ("insert", "replace") and any(s is plan.edits[-1].target for s in module.body):
        # definitions a patch writes at top level are roots, as add_definition's are: never pruned away
        plan.added_names.update(_defined_names(parse_statements(plan.edits[-1].code, patch)))


def _conflicts(edits: list[Edit]) -> list[PlanError]:
    """A node edited by one patch must not sit inside a node another patch replaces wholesale.

    The earlier replacing patch wins: one error per later patch that edits inside it (a patch found in conflict
    replaces nothing itself)."""
    errors: dict[int, PlanError] = {}
    for outer in edits:
        if outer.kind not in ("replace", "replace_def") or outer.patch.index in errors:
            continue
        inside = {id(n) for node in (outer.target, *outer.span) for n in _subtree(node)} - {id(outer.target)}
        for edit in edits:
            same = edit.target is outer.target and edit.kind not in ("before", "after")
            if (
                edit.patch.index != outer.patch.index
                and edit.patch.index not in errors
                and (id(edit.target) in inside or same)
            ):
                errors[edit.patch.index] = PlanError(
                    edit.patch,
                    f"conflicts with patch {outer.patch.index} ({outer.patch.template.name}), which "
                    f"replaces the code this patch edits; merge them or re-anchor",
                    kind=CONFLICT,
                )
    return list(errors.values())


def _subtree(node: cst.CSTNode):
    yield node
    for child in node.children:
        yield from _subtree(child)
