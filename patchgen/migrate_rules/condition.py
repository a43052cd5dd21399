"""Rule 4, a changed condition: an insert before/after a branch follows the only `if` testing one and-ed
conjunct more or fewer."""

from __future__ import annotations

import ast

import libcst as cst

from patchgen.cst.locate import NodeIndex, normalize_anchor
from patchgen.cst.scopes import find_scope
from patchgen.migrate_rules.common import header
from patchgen.migrate_rules.meaning import canonical
from patchgen.spec import Patch


def _conjuncts(text: str | None) -> frozenset[str] | None:
    try:
        body = ast.parse(text).body if text else []
    except SyntaxError:
        return None
    if len(body) != 1 or not isinstance(body[0], ast.If):
        return None
    test = body[0].test
    parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    return frozenset(canonical(ast.unparse(part)) for part in parts)


def condition_rule(
    patch: Patch, module: cst.Module, where: str | None = None
) -> tuple[dict[str, str], str] | str | None:
    """Rule 4, or None when the anchor is no `if` header of a before/after insert. The insert stays before (after)
    the same branch when exactly one `if` of the scope tests the old conditions with one more or one fewer and-ed
    (`if pixel_values is not None:` -> `if mm_encoder_outputs.get('image') is None and pixel_values is not None:`)."""
    key = "before" if patch.before else "after"
    old = _conjuncts(normalize_anchor(getattr(patch, key) or ""))
    if patch.template.op != "insert" or old is None or patch.through is not None:
        return None
    scope, index = find_scope(module, where or patch.scope), NodeIndex()
    keys = [k for s in index.statements(scope) if (k := index.statement_key(s))]
    fits = sorted({k for k in keys if (c := _conjuncts(k)) is not None and (c < old or c > old)})
    if len(fits) != 1:
        return f"rule 4: {len(fits)} `if` headers test one conjunct more or fewer"
    if keys.count(fits[0]) != 1:
        return f"rule 4: `{header(fits[0])}` occurs {keys.count(fits[0])} times in the scope"
    new = _conjuncts(fits[0])
    change = ", ".join([*(f"+ `{c}`" for c in sorted(new - old)), *(f"- `{c}`" for c in sorted(old - new))])
    why = f"rule 4 (changed condition): the only `if` of the scope testing the old conditions {change}"
    return {key: header(fits[0])}, why
