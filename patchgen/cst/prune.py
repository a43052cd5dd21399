"""Keep only what the spec's roots reach; refuse to leave a reference to anything removed.

Only top-level classes and functions are pruned. Every other top-level statement (imports, assignments,
module-level `if`/`try` blocks) is kept and its references count as roots, so module behaviour never changes.

A companion module (`patchgen.units`) is pruned differently (`companion_layout`): it redefines only its `keep` roots
(and what its patches add); every other definition they use is imported from the upstream module, so it stays the
very object upstream code uses, and only the module-level statements that bind a name the kept code uses are kept
(a shared module's trailing tables name every definition in it).
"""

from __future__ import annotations

import ast
import functools
import symtable
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass

import libcst as cst

from patchgen.cst.locate import code_of


class DanglingReference(Exception):
    pass


@functools.lru_cache(maxsize=16)
def parsed(text: str, filename: str) -> ast.Module:
    """`ast.parse`, once per text: pruning, the name checks and the companion link check share an upstream tree."""
    return ast.parse(text, filename=filename)


def references(node: ast.AST) -> set[str]:
    """Every `Name` id in the subtree (an explicit stack over `_fields`: twice as fast as `ast.walk`)."""
    names: set[str] = set()
    stack: list = [node]
    while stack:
        current = stack.pop()
        if type(current) is ast.Name:
            names.add(current.id)
            continue
        for field in current._fields:
            value = getattr(current, field, None)
            if type(value) is list:
                stack.extend(item for item in value if isinstance(item, ast.AST))
            elif isinstance(value, ast.AST):
                stack.append(value)
    return names


def reachable_definitions(tree: ast.Module, roots: Iterable[str], exclude: Iterable[str] = ()) -> set[str]:
    """Names of top-level definitions reachable from `roots` and from every non-definition statement. An excluded
    definition is never reached, so nothing stays alive only because it refers to it."""
    defs: dict[str, set[str]] = {}
    pending = set(roots)
    for stmt in tree.body:
        if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            defs.setdefault(stmt.name, set()).update(references(stmt))
        else:
            pending |= references(stmt)
    seen: set[str] = set(exclude)
    while pending:
        name = pending.pop()
        if name in defs and name not in seen:
            seen.add(name)
            pending |= defs[name]
    return seen - set(exclude)


def bound_names(node: ast.AST) -> set[str]:
    """Every name a statement binds anywhere inside it (assignments, imports, definitions, loop and with targets)."""
    names: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
            names.add(sub.id)
        elif isinstance(sub, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(sub.name)
        elif isinstance(sub, ast.alias):
            names.add(sub.asname or sub.name.split(".")[0])
        elif isinstance(sub, ast.arg):
            names.add(sub.arg)
    return names


@dataclass(frozen=True)
class CompanionLayout:
    """What a companion module keeps of its upstream module."""

    dropped: frozenset[int]  # ids of the top-level statements (pristine nodes) that go
    imported: tuple[str, ...]  # upstream definitions the kept code uses: imported from the upstream module


def is_import(stmt: cst.CSTNode) -> bool:
    """A statement line of imports only."""
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, cst.Import | cst.ImportFrom) for s in stmt.body
    )


def companion_layout(
    module: cst.Module, roots: set[str], rendered: Iterable[str], anchored: set[int]
) -> CompanionLayout:
    """Imports, the docstring and statements a patch anchors on (`anchored`: node ids) stay; another module-level
    statement stays when it binds a name the kept code (roots, patches, kept statements) uses."""
    definitions = {s.name.value: s for s in module.body if isinstance(s, cst.ClassDef | cst.FunctionDef)}
    needed: set[str] = set()
    for name in sorted(roots & set(definitions)):
        needed |= references(ast.parse(code_of(definitions[name])))
    for code in rendered:
        needed |= references(ast.parse(textwrap.dedent(code)))
    pending: dict[int, tuple[set[str], set[str]]] = {}
    for position, stmt in enumerate(module.body):
        if isinstance(stmt, cst.ClassDef | cst.FunctionDef) or is_import(stmt) or id(stmt) in anchored:
            continue
        tree = ast.parse(code_of(stmt))
        if position == 0 and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant):
            continue  # the module docstring
        pending[id(stmt)] = (bound_names(tree), references(tree))
    changed = True
    while changed:  # a kept statement's own references may need further statements
        changed = False
        for key, (bound, refs) in list(pending.items()):
            if bound & needed:
                needed |= refs
                del pending[key]
                changed = True
    imported = tuple(sorted(n for n in needed if n in definitions and n not in roots))
    return CompanionLayout(frozenset(pending), imported)


def prune(module: cst.Module, keep: set[str]) -> tuple[cst.Module, list[str]]:
    """Drop top-level definitions not in `keep`; returns the new module and the removed names."""
    all_defs = {s.name.value for s in module.body if isinstance(s, cst.ClassDef | cst.FunctionDef)}
    removed_names = all_defs - keep
    body, removed = [], []
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef | cst.FunctionDef) and stmt.name.value in removed_names:
            removed.append(stmt.name.value)
            continue
        body.append(_trim_all(stmt, removed_names))
    return module.with_changes(body=body), removed


def _trim_all(stmt: cst.BaseStatement, removed_names: set[str]) -> cst.BaseStatement:
    """`__all__` must not export what was pruned."""
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
        return stmt
    assign = stmt.body[0]
    if not (
        isinstance(assign, cst.Assign)
        and len(assign.targets) == 1
        and isinstance(assign.targets[0].target, cst.Name)
        and assign.targets[0].target.value == "__all__"
        and isinstance(assign.value, cst.List | cst.Tuple)
    ):
        return stmt
    elements = [
        e
        for e in assign.value.elements
        if not (isinstance(e.value, cst.SimpleString) and e.value.evaluated_value in removed_names)
    ]
    if len(elements) == len(assign.value.elements):
        return stmt
    if elements:  # the last kept element inherits the original's trailing comma style
        elements[-1] = elements[-1].with_changes(comma=assign.value.elements[-1].comma)
    new_value = assign.value.with_changes(elements=elements)
    return stmt.with_changes(body=[assign.with_changes(value=new_value)])


def check_dangling(top: symtable.SymbolTable, removed: Iterable[str]) -> None:
    """Every global name used anywhere must still be bound at module level if it was ever removed (`top`: the
    generated module's symbol table)."""
    removed = set(removed)
    if not removed:
        return
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    missing = removed - bound
    problems: list[str] = []

    def visit(table: symtable.SymbolTable, path: str) -> None:
        for sym in table.get_symbols():
            name = sym.get_name()
            if name in missing and sym.is_referenced() and (table is top or sym.is_global()):
                problems.append(f"{path or '<module>'} (line {table.get_lineno()}) uses {name!r}")
        for child in table.get_children():
            visit(child, f"{path}.{child.get_name()}" if path else child.get_name())

    visit(top, "")
    if problems:
        raise DanglingReference("; ".join(sorted(set(problems))))
