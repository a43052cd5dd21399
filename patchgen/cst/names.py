"""Identifier variables must name something the generated code can see.

A template variable of kind `identifier` (or `list[identifier]`) is code: when the rendered patch reads it as a name
(not only inside a string, as an attribute or as a keyword), it must resolve in the generated module, or the module
imports and compiles and fails with NameError only when that line runs. It resolves when it is a definition or an
import of the generated module, a builtin, a name the patched scope binds (upstream's parameters and locals, or what
another patch of that scope assigns), or a name the patch's own code assigned in an earlier statement. A variable a
template declares `binds = true` names what the template itself assigns and is never checked; one it declares
`module_level = true` (a class list such as `dit/shard_tokens`' processors) must be a definition or import of the
module, never a local.
"""

from __future__ import annotations

import ast
import builtins
import symtable
import textwrap
from collections.abc import Callable, Iterable

from patchgen.cst.plan import Plan
from patchgen.cst.prune import bound_names
from patchgen.errors import PatchgenError
from patchgen.spec import Patch

BUILTINS = frozenset(dir(builtins))
DEFINITIONS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def module_names(table: symtable.SymbolTable) -> set[str]:
    """The names bound at the top level of a module (definitions, imports, assignments)."""
    return {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}


def read_before_bound(code: str) -> set[str]:
    """Names the code reads before it binds them itself (statement by statement: `x = f(x)` reads x first)."""
    bound: set[str] = set()
    read: set[str] = set()
    for stmt in ast.parse(textwrap.dedent(code)).body:
        loads = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        read |= loads - bound
        bound |= bound_names(stmt)
    return read


def _identifier_values(patch: Patch) -> list[tuple[str, str, bool]]:
    """(var name, value, whether it must be module-level) of every identifier value the template does not declare
    as a name it binds."""
    out = []
    for var in patch.template.vars:
        if var.kind.scalar != "identifier" or var.binds:
            continue
        value = patch.vars.get(var.name, None if var.required else var.default)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str):
                out.append((var.name, item, var.module_level))
    return out


def _scope_names(tree: ast.Module, patch: Patch, others: Iterable[str]) -> set[str]:
    """Names bound in the patched scope: by upstream code anywhere in the (outermost) function the scope lies in, in
    the body of a class scope, and by the rendered code of the other patches of the same scope."""
    names: set[str] = set()
    body, node = tree.body, None
    for part in patch.scope.split("."):
        node = next((s for s in body if isinstance(s, DEFINITIONS) and s.name == part), None)
        if node is None or not isinstance(node, ast.ClassDef):
            break
        body = node.body
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        names |= bound_names(node)
    elif isinstance(node, ast.ClassDef):
        for stmt in node.body:
            names |= {stmt.name} if isinstance(stmt, DEFINITIONS) else bound_names(stmt)
    for code in others:
        names |= bound_names(ast.parse(textwrap.dedent(code)))
    return names


def check_identifier_vars(
    patches: Iterable[Patch],
    plan: Plan,
    tree: Callable[[], ast.Module],
    table: symtable.SymbolTable,
    where: str,
    output: str,
) -> None:
    """Raise PatchgenError for the first identifier value a patch reads that resolves to nothing (see above); `tree`
    gives the upstream module's ast (the scopes as upstream wrote them), `table` holds the generated module's."""
    top: set[str] | None = None
    patches = list(patches)
    for patch in patches:
        values = _identifier_values(patch)
        codes = plan.rendered_by.get(patch.index, [])
        if not values or not codes:
            continue
        read = set().union(*(read_before_bound(code) for code in codes))
        unresolved = [(v, value, top_only) for v, value, top_only in values if value in read and value not in BUILTINS]
        if not unresolved:
            continue
        top = module_names(table) if top is None else top
        unresolved = [(v, value, top_only) for v, value, top_only in unresolved if value not in top]
        for var, value, top_only in unresolved:
            if top_only:  # a class list (processors): a local of the scope would be no class of the module
                raise PatchgenError(
                    f"{where}: {patch.label}: vars.{var} = {value!r} names no definition or import of {output}: "
                    f"{var} names classes of the module, never a parameter or local of {patch.where}. Name a class "
                    f"the module defines or imports (a pruned definition: add it to 'keep'); a class of a shared "
                    f"module it never imports: keep it in a [[companion]] of that module, and the generated module "
                    f"imports the spec's copy; or correct the name"
                )
        if not unresolved:
            continue
        others = [
            code
            for other in patches
            if other.index != patch.index and other.scope == patch.scope
            for code in plan.rendered_by.get(other.index, [])
        ]
        scope = _scope_names(tree(), patch, others) if patch.scope != "<module>" else set()
        for var, value, _ in unresolved:
            if value not in scope:
                raise PatchgenError(
                    f"{where}: {patch.label}: vars.{var} = {value!r} names nothing {output} defines or imports, nor "
                    f"a parameter or local of {patch.where}: the generated code would raise NameError when it runs. "
                    f"Name a definition or import of the generated module (a pruned definition: add it to 'keep'), "
                    f"or correct the name"
                )
