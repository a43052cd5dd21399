"""Resolve every patch of a spec to the upstream node it edits, before anything is edited.

Resolving first means errors name upstream lines, a patch can never anchor on code another patch wrote,
and the rewrite itself is a single pass keyed by node identity.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import libcst as cst

from patchgen.cst.locate import (
    LocateError,
    NodeIndex,
    code_of,
    find_expression,
    find_statement,
    find_statement_range,
    scope_chain,
)
from patchgen.spec import Patch


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
    scope_ids: set[int] = field(default_factory=set)  # patch scopes: visit everything inside

    def by_target(self) -> dict[int, list[Edit]]:
        table: dict[int, list[Edit]] = {}
        for edit in self.edits:
            table.setdefault(id(edit.target), []).append(edit)
        return table


class PlanError(Exception):
    def __init__(self, patch: Patch, message: str, candidates: list[tuple[str, cst.CSTNode]] | None = None) -> None:
        super().__init__(message)
        self.patch = patch
        self.message = message
        self.candidates = candidates or []


def parse_statements(code: str, patch: Patch) -> list[cst.BaseStatement]:
    try:
        module = cst.parse_module(textwrap.dedent(code))
    except cst.ParserSyntaxError as exc:
        raise PlanError(patch, f"rendered template is not valid Python: {exc}\n--- rendered ---\n{code}") from exc
    body = list(module.body)
    if not body:
        raise PlanError(patch, "rendered template is empty")
    header = list(module.header)  # comments above the first statement belong to it, not to a "file header"
    while header and header[0].comment is None:
        header.pop(0)
    return [body[0].with_changes(leading_lines=[*header, *body[0].leading_lines]), *body[1:]]


def _defined_names(statements: list[cst.BaseStatement]) -> list[str]:
    return [s.name.value for s in statements if isinstance(s, cst.ClassDef | cst.FunctionDef)]


def resolve(module: cst.Module, patches: tuple[Patch, ...]) -> Plan:
    plan = Plan()
    index = NodeIndex()
    for patch in patches:
        try:
            _resolve_one(module, patch, plan, index)
        except LocateError as exc:
            raise PlanError(patch, exc.message, exc.candidates) from exc
        for line in patch.template.imports:
            if line not in plan.imports:
                plan.imports.append(line)
    _check_conflicts(plan)
    return plan


def _resolve_one(module: cst.Module, patch: Patch, plan: Plan, index: NodeIndex) -> None:
    op = patch.template.op

    def render(values: dict) -> str:
        code = patch.template.render(values)
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
            target = find_statement(module, patch.anchor_text, patch.scope)
            plan.edits.append(Edit(patch, "before" if patch.before else "after", target, code))
        return
    chain = scope_chain(module, patch.scope)
    scope = chain[-1]
    plan.chain_ids.update(id(n) for n in chain)
    plan.scope_ids.add(id(scope))
    variables = {**patch.vars, "scope": patch.scope}
    if op == "insert":
        target = find_statement(scope, patch.anchor_text, patch.scope)
        plan.edits.append(Edit(patch, "before" if patch.before else "after", target, render(variables)))
    elif op == "replace":
        if patch.through is None:
            run = [find_statement(scope, patch.anchor, patch.scope)]
        else:
            run = find_statement_range(scope, patch.anchor, patch.through, patch.scope)
        plan.edits.append(Edit(patch, "replace", run[0], render(variables), tuple(run[1:])))
    elif op == "wrap":
        target = find_expression(scope, patch.anchor, patch.scope, index)
        code = render({**variables, "expr": code_of(target)})  # validate now; re-rendered on the final tree
        try:
            cst.parse_expression(code.strip())
        except cst.ParserSyntaxError as exc:
            raise PlanError(patch, f"rendered wrap is not a Python expression: {code.strip()!r}") from exc
        plan.edits.append(Edit(patch, "wrap", target, ""))
    elif op == "add_method":
        if not isinstance(scope, cst.ClassDef):
            raise PlanError(patch, f"op add_method needs a class scope, {patch.scope!r} is not a class")
        code = render(variables)
        existing = {s.name.value for s in scope.body.body if isinstance(s, cst.FunctionDef)}
        clash = sorted(existing & set(_defined_names(parse_statements(code, patch))))
        if clash:
            raise PlanError(patch, f"{patch.scope} already defines {clash}; use a replace_method template instead")
        plan.edits.append(Edit(patch, "add_members", scope, code))
    elif op in ("replace_method", "replace_definition"):
        want_method = op == "replace_method"
        if want_method != ("." in patch.scope) or not isinstance(scope, cst.FunctionDef | cst.ClassDef):
            shape = "'Class.method'" if want_method else "a top-level class or function name"
            raise PlanError(patch, f"op {op} takes scope {shape}, found {patch.scope!r}")
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


def _check_conflicts(plan: Plan) -> None:
    """A node edited by one patch must not sit inside a node another patch replaces wholesale."""
    replaced = [e for e in plan.edits if e.kind in ("replace", "replace_def")]
    for outer in replaced:
        inside = {id(n) for node in (outer.target, *outer.span) for n in _subtree(node)} - {id(outer.target)}
        for edit in plan.edits:
            same = edit.target is outer.target and edit.kind not in ("before", "after")
            if edit is not outer and (id(edit.target) in inside or same):
                raise PlanError(edit.patch, f"conflicts with patch {outer.patch.index} ({outer.patch.template.name}),"
                                            f" which replaces the code this patch edits; merge them or re-anchor")


def _subtree(node: cst.CSTNode):
    yield node
    for child in node.children:
        yield from _subtree(child)
