"""Rule 3, the same variable bound by other code: an insert after an assignment, or a template re-implementing
the whole `target =` statement, follows the (last, unbranched) statement binding the same targets."""

from __future__ import annotations

import ast

import libcst as cst

from patchgen.accounting import matches, normalize_start, substitute
from patchgen.cst.locate import NodeIndex, normalize_anchor
from patchgen.cst.scopes import find_scope
from patchgen.migrate_rules.common import header
from patchgen.migrate_rules.meaning import canonical
from patchgen.spec import Patch


def _bound(text: str | None) -> str | None:
    """What a single plain or annotated assignment binds (its targets, the annotation left out), else None."""
    try:
        body = ast.parse(text).body if text else []
    except SyntaxError:
        return None
    if len(body) != 1 or not isinstance(body[0], ast.Assign | ast.AnnAssign) or body[0].value is None:
        return None
    targets = body[0].targets if isinstance(body[0], ast.Assign) else [body[0].target]
    return " = ".join(canonical(ast.unparse(t)) for t in targets)


def _binders(scope: cst.CSTNode, targets: str) -> tuple[list[str], bool]:
    """The statements binding `targets` in the scope (normalized, in source order), and whether they are all
    statements of the scope's own body (no branch or loop decides which binding holds)."""
    index = NodeIndex()
    found = [(s, k) for s in index.statements(scope) if (k := index.statement_key(s)) and _bound(k) == targets]
    top = {id(s) for s in getattr(getattr(scope, "body", None), "body", ())}
    return [k for _, k in found], all(id(s) in top for s, _ in found)


def _values(patch: Patch) -> dict[str, object]:
    return {v.name: patch.vars.get(v.name, None if v.required else v.default) for v in patch.template.vars}


def rebound_rule(
    patch: Patch, module: cst.Module, old: cst.Module | None, where: str | None = None
) -> tuple[dict[str, str], str] | str | None:
    """Rule 3, or None when the anchor is no single assignment the rule speaks about. An `after` insert runs once
    its anchor's variables are bound; a `replace` whose template declares it re-implements `target =` rewrites the
    whole statement. Either keeps its meaning when upstream binds the same targets by other code (a tuple became a
    call, another callee), provided they are bound once in the scope, before and now (for an insert: the last
    binding, when every binding is a statement of the scope's own body, before and now)."""
    op, key = patch.template.op, ("after" if patch.after else "anchor")
    if (op, key) not in (("insert", "after"), ("replace", "anchor")) or patch.through is not None:
        return None
    targets = _bound(normalize_anchor(getattr(patch, key)))
    if targets is None:
        return None
    anchor = normalize_anchor(getattr(patch, key))
    new, flat = _binders(find_scope(module, where or patch.scope), targets)
    before, flat_before = _binders(find_scope(old, patch.scope), targets) if old is not None else ([], False)
    last = op == "insert" and flat and flat_before  # the value the code after reads: the last binding, both times
    if before != [anchor] and not (last and before[-1:] == [anchor]):
        return f"rule 3: `{targets}` was not bound once (or last, by the scope's own body) in the old scope"
    new = new[-1:] if last else new
    if len(new) != 1:
        return f"rule 3: `{targets}` is bound {len(new)} times in the scope"
    if op == "replace":
        values = _values(patch)
        starts = [normalize_start(substitute(r.start, values)) for r in patch.template.reimplements]
        if not any(matches(start, new[0]) and not start.endswith("(") for start in starts):
            return f"rule 3: the template does not declare it re-implements `{targets} =`"
    how = "the patch runs after it" if op == "insert" else "the template re-implements the whole statement"
    once = "last bound by the scope's own body" if last and len(before) + len(new) > 2 else "bound once"
    return {key: header(new[0])}, f"rule 3 (same variable, other code): `{targets}` is {once}, as before; {how}"
