"""Apply a resolved plan in one libcst pass; untouched nodes are reprinted byte for byte.

The pass is generic: for each node an edit targets, it calls the edit's operation (`patchgen/ops/`) at the right
moment: expressions when they are left; statements in two phases (edits that change the statement itself, then,
after the markers of wraps and renames inside it are attached, edits that add or replace statements around it); the
module body last. Besides the patches, the pass makes relative imports absolute (generated files live in another
package; libcst's import helpers compute the name), re-points imports of names the spec's companions redefine to
the generated companion (`patchgen.units`), drops the statements a companion does not keep, and the templates'
imports are inserted as one block. Every patched region gets a one-line marker comment: `# patchgen #<index>
<template> (<n> stmt): <why>`; the region is the <n> statements that follow it. A re-pointed import is marked
`# patchgen companion (1 stmt): ...`.
"""

from __future__ import annotations

import textwrap

import libcst as cst
from libcst.helpers import get_absolute_module_for_import_or_raise, get_full_name_for_node

from patchgen.cst.locate import code_of
from patchgen.cst.plan import Plan
from patchgen.cst.prune import is_import
from patchgen.ops.base import Edit, Splice, marker_text, patch_label
from patchgen.ops.rename import Rename, Renamer
from patchgen.units import Redefined

NO_COMPANIONS = Redefined()


def with_marker(stmt: cst.BaseStatement, text: str) -> cst.BaseStatement:
    return stmt.with_changes(leading_lines=[*stmt.leading_lines, cst.EmptyLine(comment=cst.Comment(text))])


def dotted_name(path: str) -> cst.Name | cst.Attribute:
    """`a.b.c` as a libcst node, built directly (parsing a snippet per import costs more than the whole edit)."""
    head, *rest = path.split(".")
    node: cst.Name | cst.Attribute = cst.Name(head)
    for part in rest:
        node = cst.Attribute(value=node, attr=cst.Name(part))
    return node


def has_import_to_rewrite(node: cst.CSTNode, companions: Redefined = NO_COMPANIONS) -> bool:
    """Whether a statement in `node`'s nested blocks is a relative import, or an import from a module a companion
    redefines names of (walks blocks, never expressions)."""
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, cst.SimpleStatementLine | cst.SimpleStatementSuite):
            for small in current.body:
                if isinstance(small, cst.ImportFrom) and (
                    small.relative or companions.by_module and _module_name(small) in companions.by_module
                ):
                    return True
            continue
        for name in ("body", "orelse", "handlers", "finalbody", "cases"):
            value = getattr(current, name, None)
            if isinstance(value, cst.CSTNode):
                stack.append(value)
            elif isinstance(value, list | tuple):
                stack.extend(v for v in value if isinstance(v, cst.CSTNode))
    return False


def _module_name(node: cst.ImportFrom) -> str:
    return get_full_name_for_node(node.module) if node.module is not None else ""


class PatchTransformer(cst.CSTTransformer):
    def __init__(
        self,
        plan: Plan,
        module_name: str,
        companions: Redefined = NO_COMPANIONS,
        dropped: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__()
        self.edits = plan.by_target()
        self.companions = companions
        self._removed = {id(node) for edit in plan.edits for node in edit.span} | dropped
        renames = [e for e in plan.edits if isinstance(e.op, Rename)]
        self.renamer = Renamer(renames) if renames else None
        self.module_name = module_name
        self.applied: dict[int, int] = {}
        self._markers: list[list[str]] = []  # one list per statement being visited
        self._visit_ids = plan.chain_ids | plan.path_ids

    # -- what operations call ----------------------------------------------------------------------------------
    def count(self, edit: Edit) -> None:
        """Record that `edit` was applied (the engine checks every patch applied exactly once)."""
        self.applied[edit.patch.index] = self.applied.get(edit.patch.index, 0) + 1

    def mark(self, edit: Edit) -> None:
        """A one-statement marker above the innermost statement being rewritten (wraps)."""
        self._markers[-1].append(marker_text(patch_label(edit.patch), 1, edit.patch.why))

    # -- the walk ------------------------------------------------------------------------------------------------
    def _skips(self, node: cst.CSTNode) -> bool:
        """Whether nothing below `node` can change: no edit on the way down, no relative import inside."""
        if self.renamer is not None or id(node) in self._visit_ids:
            return False
        if isinstance(node, cst.BaseStatement):
            return not has_import_to_rewrite(node, self.companions)
        return isinstance(node, cst.BaseExpression)  # an expression off every edit path holds no edit

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, cst.BaseStatement):
            self._markers.append([])
        if self._skips(node):
            return False  # its on_leave still runs, for statement-level edits and removals
        if self.renamer is not None:
            return self.renamer.visit(node)
        return True

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode):
        edits = self.edits.get(id(original), [])
        if self.renamer is not None:
            updated = self.renamer.leave(original, updated, self._markers[-1] if self._markers else [])
        if isinstance(original, cst.ImportFrom) and original.relative:
            updated = self._absolute(updated)
        if isinstance(original, cst.BaseExpression):
            for edit in edits:
                updated = edit.op.apply_expression(edit, updated, self)
        if isinstance(original, cst.BaseStatement):
            return self._leave_statement(original, updated, edits)
        if isinstance(original, cst.Module):
            body = list(updated.body)
            for edit in edits:
                edit.op.apply_module(edit, body, self)
            return updated.with_changes(body=body)
        return updated

    def _absolute(self, node: cst.ImportFrom) -> cst.ImportFrom:
        target = get_absolute_module_for_import_or_raise(self.module_name, node)
        return node.with_changes(relative=[], module=dotted_name(target))

    def _leave_statement(self, original, updated, edits: list[Edit]):
        markers = self._markers.pop()
        if id(original) in self._removed:
            return cst.RemovalSentinel.REMOVE  # part of a replaced run; the replacement sits at the run's start
        for edit in edits:
            updated = edit.op.apply_in_place(edit, updated, self)
        for text in dict.fromkeys(markers):  # a statement touched twice by one patch gets one marker
            updated = with_marker(updated, text)
        splice = Splice(middle=[updated])
        if self.companions.by_module and isinstance(updated, cst.SimpleStatementLine):
            splice.middle = self._repoint(updated)
        for edit in edits:
            edit.op.apply_around(edit, splice, self)
        if not splice.before and not splice.after and len(splice.middle) == 1 and splice.middle[0] is updated:
            return updated
        return cst.FlattenSentinel([*splice.before, *splice.middle, *splice.after])

    def _repoint(self, line: cst.SimpleStatementLine) -> list[cst.SimpleStatementLine]:
        """`from m import A, B` where a companion redefines B -> `from m import A` and, marked, `from <generated
        companion> import B`: the spec's generated files use the redefinition, upstream the rest."""
        kept, moved = [], []
        for small in line.body:
            target = None
            if (
                isinstance(small, cst.ImportFrom)
                and not small.relative
                and not isinstance(small.names, cst.ImportStar)
            ):
                module = _module_name(small)
                target = self.companions.by_module.get(module)
            if target is None:
                kept.append(small)
                continue
            names = target[1]
            mine = [a for a in small.names if get_full_name_for_node(a.name) in names]
            rest = [a for a in small.names if get_full_name_for_node(a.name) not in names]
            if mine:
                aliases = [cst.ImportAlias(name=a.name, asname=a.asname) for a in mine]
                moved.append((cst.ImportFrom(module=dotted_name(target[0]), names=aliases), target[0]))
            if rest:
                rest[-1] = rest[-1].with_changes(comma=small.names[-1].comma)
                kept.append(small.with_changes(names=rest))
        if not moved:
            return [line]
        out = [line.with_changes(body=kept)] if kept else []
        for index, (node, module) in enumerate(moved):
            names = ", ".join(get_full_name_for_node(a.name) for a in node.names)
            marker = cst.EmptyLine(comment=cst.Comment(marker_text("companion", 1, f"{names} redefined in {module}")))
            leading = [*line.leading_lines, marker] if not kept and index == 0 else [marker]
            out.append(cst.SimpleStatementLine(body=[node], leading_lines=leading))
        return out


def insert_imports(
    module: cst.Module, imports: list[str], label: str = "imports", why: str = "names the patches below use"
) -> cst.Module:
    """Add import lines as one marked block after the module's leading imports (the templates' imports; a
    companion's imports of the upstream definitions it does not redefine).

    (libcst's AddImportsVisitor merges names into existing `from x import` lines; a marked block of its own keeps
    the review diff one reviewable hunk, so it is not used here.)"""
    existing = {code_of(s).strip() for s in module.body if is_import(s)}
    wanted = [line for line in imports if line.strip() not in existing]
    if not wanted:
        return module
    body = list(module.body)
    position = 0
    for index, stmt in enumerate(body):
        if isinstance(stmt, cst.ClassDef | cst.FunctionDef):
            break
        if is_import(stmt):
            position = index + 1
    block = list(cst.parse_module(textwrap.dedent("\n".join(wanted)) + "\n").body)
    marker = marker_text(label, len(block), why)
    block[0] = block[0].with_changes(leading_lines=[cst.EmptyLine(comment=cst.Comment(marker))])
    return module.with_changes(body=[*body[:position], *block, *body[position:]])
