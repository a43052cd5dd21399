"""Rule 5, code moved into the definition the old scope delegates to (`self.model = ThinkerModel(config)`, then
`self.model(...)`): the unchanged anchor, or rule 1, 3 or 4, in exactly one delegate."""

from __future__ import annotations

import ast
import textwrap

import libcst as cst

from patchgen.cst.locate import LocateError, NodeIndex, code_of, normalize_anchor
from patchgen.cst.scopes import find_scope
from patchgen.migrate_rules.anchor import anchor_rule
from patchgen.migrate_rules.condition import condition_rule
from patchgen.migrate_rules.rebound import rebound_rule
from patchgen.spec import Patch


def _delegates(module: cst.Module, scope: str) -> list[str]:
    """`D.m` (or `D` for a class scope `C`) for each attribute `self.a = D(...)` / `D._from_config(...)` that
    `C.__init__` binds to a class D of the module, when the new `C.m` calls `self.a(...)` (m = forward) or
    `self.a.m(...)`."""
    owner, _, method = scope.partition(".")
    try:
        init = find_scope(module, f"{owner}.__init__")
        body = find_scope(module, scope)
    except LocateError:
        return []
    classes = {c.name.value for c in module.body if isinstance(c, cst.ClassDef)}
    code, out = ast.parse(textwrap.dedent(code_of(body))) if method else None, []
    for node in ast.walk(ast.parse(textwrap.dedent(code_of(init)))):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and len(node.targets) == 1):
            continue
        attr, callee = ast.unparse(node.targets[0]), ast.unparse(node.value.func).removesuffix("._from_config")
        if not attr.startswith("self.") or callee not in classes or callee == owner:
            continue
        calls = {ast.unparse(c.func) for c in ast.walk(code) if isinstance(c, ast.Call)} if code else set()
        if method and not calls & {f"{attr}.{method}", *([attr] if method == "forward" else [])}:
            continue
        out.append(f"{callee}.{method}" if method else callee)
    return sorted(set(out))


def delegate_rule(patch: Patch, module: cst.Module, old: cst.Module | None) -> tuple[dict[str, str], str] | str | None:
    """Rule 5: the old scope still exists but its code now runs in the definition it delegates to; there the
    anchor matches unchanged, or by rule 1, 3 or 4. Exactly one delegate may fit."""
    key = "before" if patch.before else "after" if patch.after else "anchor"
    if patch.through is not None or patch.scope == "<module>":
        return None
    found: list[tuple[str, dict[str, str], str]] = []
    for where in _delegates(module, patch.scope):
        try:
            scope, index = find_scope(module, where), NodeIndex()
        except LocateError:
            continue
        wanted = normalize_anchor(getattr(patch, key))
        hits = [s for s in index.statements(scope) if index.statement_key(s) == wanted]
        if len(hits) == 1:
            found.append((where, {}, "the unchanged anchor matches once"))
            continue
        for rule in (anchor_rule, rebound_rule, condition_rule):
            args = (patch, module, old, where) if rule is rebound_rule else (patch, module, where)
            got = rule(*args)
            if isinstance(got, tuple):
                found.append((where, *got))
                break
    if len(found) != 1:
        return f"rule 5: {len(found)} delegate(s) of {patch.scope} hold the anchor" if found else None
    where, edits, why = found[0]
    scope = f"{patch.module}:{where}" if patch.module else where
    return {"scope": scope, **edits}, f"rule 5 (moved into the delegate `{where}`): {why}"
