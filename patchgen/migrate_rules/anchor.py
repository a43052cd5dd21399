"""Rule 1, a moved anchor: the same statement respelled, or the same assignment with other call arguments (a
template variable naming an old argument follows it)."""

from __future__ import annotations

import ast
import difflib

import libcst as cst

from patchgen.cst.locate import NodeIndex, code_of, normalize, normalize_anchor
from patchgen.cst.scopes import find_scope
from patchgen.cst.statement_anchors import statement_shape
from patchgen.migrate_rules.common import expressions, failed_key, header
from patchgen.migrate_rules.meaning import canonical, same_meaning
from patchgen.spec import Patch


def anchor_rule(patch: Patch, module: cst.Module, where: str | None = None) -> tuple[dict[str, str], str] | str:
    """Rule 1: the edits (key -> new value) and the reason, or why the anchor is left to the human. `where`: the
    scope to look in (rule 5 tries a delegate's method), the patch's own by default."""
    scope = find_scope(module, where or patch.scope)
    index = NodeIndex()
    key = failed_key(patch, scope, index)
    old = getattr(patch, key)
    if patch.template.op == "wrap":
        wanted = normalize(old, "eval")
        pool = [(n, normalize(code_of(n), "eval")) for n in expressions(scope, index)]
    else:
        wanted = normalize_anchor(old)
        shape = tuple(type(n).__name__ for n in ast.parse(wanted).body)
        pool = [(s, index.statement_key(s)) for s in index.statements(scope) if statement_shape(s) == shape]
    pool = [(n, k) for n, k in pool if k]
    if not pool:
        return f"no {'expression' if patch.template.op == 'wrap' else 'statement'} of the anchor's kind is left"
    ratio = {id(n): difflib.SequenceMatcher(None, wanted, k).ratio() for n, k in pool}
    fits = []
    for node, text in pool:
        verdict = (
            same_meaning(wanted, text)
            if patch.template.op != "wrap"
            else (("equal after normalising formatting", []) if canonical(wanted) == canonical(text) else None)
        )
        if verdict is not None:
            fits.append((node, text, *verdict))
    if not fits:
        nearest = max(pool, key=lambda p: ratio[id(p[0])])[1]
        return f"{key}: no statement of its kind has the same meaning (nearest `{header(nearest)}`)"
    if len(fits) > 1:
        return f"{key}: {len(fits)} candidates are equally eligible: " + "; ".join(
            f"`{header(t)}`" for _, t, *_ in fits
        )
    node, text, why, pairs = fits[0]
    rivals = [k for n, k in pool if n is not node and ratio[id(n)] >= ratio[id(node)] and k != text]
    if rivals:
        return f"{key}: `{header(rivals[0])}` is as near as the eligible `{header(text)}`"
    if sum(k == text for _, k in pool) > 1:
        return f"{key}: the eligible `{header(text)}` occurs {sum(k == text for _, k in pool)} times in the scope"
    edits = {key: header(text)}
    for old_arg, new_arg in pairs or []:
        for var in patch.template.vars:
            value = patch.vars.get(var.name, None if var.required else var.default)
            if var.kind.scalar == "expr" and isinstance(value, str) and normalize(value, "eval") == old_arg:
                edits[f"vars.{var.name}"] = new_arg
    follows = ", ".join(f"vars.{k.split('.', 1)[1]}" for k in edits if k.startswith("vars."))
    return edits, f"rule 1 (moved anchor): {why}" + (f"; {follows} follows the changed argument" if follows else "")
