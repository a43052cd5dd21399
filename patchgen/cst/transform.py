"""Apply a resolved plan in one libcst pass; untouched nodes are reprinted byte for byte.

Besides the patches, the pass makes relative imports absolute (generated files live in another package)
and inserts the imports the templates declare. Every patched region gets a one-line marker comment:
`# patchgen #<index> <template> (<n> stmt): <why>`; the region is the <n> statements that follow it.
"""

from __future__ import annotations

import textwrap

import libcst as cst

from patchgen.cst.locate import code_of
from patchgen.cst.plan import Edit, Plan, parse_statements

MARKER_PREFIX = "# patchgen "


def marker_text(label: str, count: int, why: str) -> str:
    return f"{MARKER_PREFIX}{label} ({count} stmt): {why}"


def _patch_label(edit: Edit) -> str:
    return f"#{edit.patch.index} {edit.patch.template.name}"


def with_marker(stmt: cst.BaseStatement, text: str) -> cst.BaseStatement:
    return stmt.with_changes(leading_lines=[*stmt.leading_lines, cst.EmptyLine(comment=cst.Comment(text))])


def marked_block(edit: Edit, code: str, leading: list[cst.EmptyLine] | None = None) -> list[cst.BaseStatement]:
    body = parse_statements(code, edit.patch)
    first = body[0].with_changes(
        leading_lines=[
            *(leading or []),
            cst.EmptyLine(comment=cst.Comment(marker_text(_patch_label(edit), len(body), edit.patch.why))),
            *body[0].leading_lines,
        ]
    )
    return [first, *body[1:]]


def absolute_module(module: str, level: int, name: str | None) -> str:
    package = module.split(".")[:-level]
    return ".".join([*package, name] if name else package)


def dotted_name(path: str) -> cst.Name | cst.Attribute:
    """`a.b.c` as a libcst node, built directly (parsing a snippet per import costs more than the whole edit)."""
    head, *rest = path.split(".")
    node: cst.Name | cst.Attribute = cst.Name(head)
    for part in rest:
        node = cst.Attribute(value=node, attr=cst.Name(part))
    return node


def has_relative_import(node: cst.CSTNode) -> bool:
    """Whether a statement in `node`'s nested blocks is a relative import (walks blocks, never expressions)."""
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, cst.SimpleStatementLine | cst.SimpleStatementSuite):
            if any(isinstance(small, cst.ImportFrom) and small.relative for small in current.body):
                return True
            continue
        for name in ("body", "orelse", "handlers", "finalbody", "cases"):
            value = getattr(current, name, None)
            if isinstance(value, cst.CSTNode):
                stack.append(value)
            elif isinstance(value, list | tuple):
                stack.extend(v for v in value if isinstance(v, cst.CSTNode))
    return False


class PatchTransformer(cst.CSTTransformer):
    def __init__(self, plan: Plan, module_name: str) -> None:
        super().__init__()
        self.edits = plan.by_target()
        self._removed = {id(node) for edit in plan.edits for node in edit.span}
        self.renames = {e.target.name.value: e for e in plan.edits if e.kind == "rename"}
        self.module_name = module_name
        self.applied: dict[int, int] = {}
        self._markers: list[list[str]] = []  # one list per statement being visited
        self._not_references: set[int] = set()
        self._visit_ids = plan.chain_ids | plan.path_ids

    def _count(self, edit: Edit) -> None:
        self.applied[edit.patch.index] = self.applied.get(edit.patch.index, 0) + 1

    def _skips(self, node: cst.CSTNode) -> bool:
        """Whether nothing below `node` can change: no edit on the way down, no relative import inside."""
        if self.renames or id(node) in self._visit_ids:
            return False
        if isinstance(node, cst.BaseStatement):
            return not has_relative_import(node)
        return isinstance(node, cst.BaseExpression)  # an expression off every edit path holds no edit

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, cst.BaseStatement):
            self._markers.append([])
        if self._skips(node):
            return False  # its on_leave still runs, for statement-level edits and removals
        if self.renames:
            if isinstance(node, cst.Attribute):
                self._not_references.add(id(node.attr))
            elif isinstance(node, cst.Arg) and node.keyword is not None:
                self._not_references.add(id(node.keyword))
            elif isinstance(node, cst.ImportAlias | cst.ImportFrom):
                return False  # an import binds upstream names; never rename inside it
        return True

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode):
        edits = self.edits.get(id(original), [])
        renamed = isinstance(original, cst.Name) and original.value in self.renames
        if renamed and id(original) not in self._not_references:
            edit = self.renames[original.value]
            updated = updated.with_changes(value=edit.code)
            self._markers[-1].append(marker_text(_patch_label(edit), 1, edit.patch.why))
        if isinstance(original, cst.ImportFrom) and original.relative:
            updated = self._absolute(updated)
        if self.renames and isinstance(original, cst.Assign):
            updated = self._rename_exports(updated)
        if isinstance(original, cst.BaseExpression):
            for edit in edits:
                if edit.kind == "wrap":
                    updated = self._wrap(edit, updated)
        if isinstance(original, cst.BaseStatement):
            return self._leave_statement(original, updated, edits)
        if isinstance(original, cst.Module):
            return self._leave_module(updated, edits)
        return updated

    def _wrap(self, edit: Edit, expr: cst.BaseExpression) -> cst.BaseExpression:
        code = edit.patch.template.render({**edit.patch.vars, "scope": edit.patch.scope, "expr": code_of(expr)})
        self._count(edit)
        self._markers[-1].append(marker_text(_patch_label(edit), 1, edit.patch.why))
        return cst.parse_expression(code.strip())

    def _rename_exports(self, node: cst.Assign) -> cst.Assign:
        """`__all__` names definitions in strings: a renamed definition is exported under its new name."""
        if not (
            len(node.targets) == 1
            and isinstance(node.targets[0].target, cst.Name)
            and node.targets[0].target.value == "__all__"
            and isinstance(node.value, cst.List | cst.Tuple)
        ):
            return node
        elements = []
        for element in node.value.elements:
            value = element.value
            if isinstance(value, cst.SimpleString) and value.evaluated_value in self.renames:
                edit = self.renames[value.evaluated_value]
                element = element.with_changes(
                    value=value.with_changes(value=f"{value.prefix}{value.quote}{edit.code}{value.quote}")
                )
                self._markers[-1].append(marker_text(_patch_label(edit), 1, edit.patch.why))
            elements.append(element)
        return node.with_changes(value=node.value.with_changes(elements=elements))

    def _absolute(self, node: cst.ImportFrom) -> cst.ImportFrom:
        name = code_of(node.module) if node.module is not None else None
        target = absolute_module(self.module_name, len(node.relative), name)
        return node.with_changes(relative=[], module=dotted_name(target))

    def _leave_statement(self, original, updated, edits: list[Edit]):
        markers = self._markers.pop()
        if id(original) in self._removed:
            return cst.RemovalSentinel.REMOVE  # part of a replaced run; the replacement sits at the run's start
        for edit in edits:
            if edit.kind == "add_members":
                self._count(edit)
                members = marked_block(edit, edit.code, leading=[cst.EmptyLine(indent=False)])
                updated = updated.with_changes(body=updated.body.with_changes(body=[*updated.body.body, *members]))
            elif edit.kind == "rename":
                self._count(edit)
        for text in dict.fromkeys(markers):  # a statement touched twice by one patch gets one marker
            updated = with_marker(updated, text)
        before, after, replacement = [], [], None
        for edit in edits:
            if edit.kind in ("before", "after"):
                self._count(edit)
                (before if edit.kind == "before" else after).extend(marked_block(edit, edit.code))
            elif edit.kind in ("replace", "replace_def"):
                self._count(edit)
                replacement = marked_block(edit, edit.code, leading=list(updated.leading_lines))
        if not (before or after or replacement is not None):
            return updated
        return cst.FlattenSentinel([*before, *(replacement if replacement is not None else [updated]), *after])

    def _leave_module(self, module: cst.Module, edits: list[Edit]) -> cst.Module:
        body = list(module.body)
        for edit in edits:
            if edit.kind == "append_module":
                self._count(edit)
                blank = [cst.EmptyLine(), cst.EmptyLine()]
                body.extend(marked_block(edit, edit.code, leading=blank))
        return module.with_changes(body=body)


def insert_imports(module: cst.Module, imports: list[str]) -> cst.Module:
    """Add the templates' imports as one marked block after the module's leading imports."""
    existing = {code_of(s).strip() for s in module.body if _is_import(s)}
    wanted = [line for line in imports if line.strip() not in existing]
    if not wanted:
        return module
    body = list(module.body)
    position = 0
    for index, stmt in enumerate(body):
        if isinstance(stmt, cst.ClassDef | cst.FunctionDef):
            break
        if _is_import(stmt):
            position = index + 1
    block = list(cst.parse_module(textwrap.dedent("\n".join(wanted)) + "\n").body)
    marker = marker_text("imports", len(block), "names the patches below use")
    block[0] = block[0].with_changes(leading_lines=[cst.EmptyLine(comment=cst.Comment(marker))])
    return module.with_changes(body=[*body[:position], *block, *body[position:]])


def _is_import(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, cst.Import | cst.ImportFrom) for s in stmt.body
    )
