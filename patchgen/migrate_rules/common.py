"""What every rule reads of a failing patch and a module: which anchor key failed, the definitions and expressions
of a scope, where an unchanged anchor now lives."""

from __future__ import annotations

import libcst as cst

from patchgen.cst.locate import LocateError, NodeIndex, code_of, normalize, normalize_anchor
from patchgen.cst.statement_anchors import find_statement
from patchgen.spec import Patch


def failed_key(patch: Patch, scope: cst.CSTNode, index: NodeIndex) -> str:
    """Which anchor key of the patch no longer matches (`through` when only the end of its run moved)."""
    key = next(k for k in ("before", "after", "anchor") if getattr(patch, k))
    if patch.through is None or patch.template.op == "wrap":
        return key
    try:
        find_statement(scope, patch.anchor_text, patch.scope, index)
    except LocateError:
        return key
    return "through"


def header(key: str) -> str:
    return key.splitlines()[0] if "\n" in key else key


def expressions(scope: cst.CSTNode, index: NodeIndex) -> list[cst.CSTNode]:
    kinds = (cst.Name, cst.Attribute, cst.Call, cst.BinaryOperation, cst.Subscript)
    return [n for kind in kinds for n in index.of_type(scope, kind)]


def definitions(node: cst.CSTNode, prefix: str = ""):
    body = node.body if isinstance(node, cst.Module) else getattr(node.body, "body", ())
    for child in body:
        if isinstance(child, cst.ClassDef | cst.FunctionDef):
            yield prefix + child.name.value, child
            yield from definitions(child, f"{prefix}{child.name.value}.")


def holders(module: cst.Module, patch: Patch) -> dict[str, int]:
    """Every definition (innermost) holding a match of the unchanged anchor, with its number of matches."""
    text, wrap = patch.anchor_text, patch.template.op == "wrap"
    wanted = normalize(text, "eval") if wrap else normalize_anchor(text)
    index, owner = NodeIndex(), {}
    for name, definition in definitions(module):  # outermost first: an inner definition overwrites its parent
        if wrap:
            hits = [n for n in expressions(definition, index) if normalize(code_of(n), "eval") == wanted]
        else:
            hits = [s for s in index.statements(definition) if index.statement_key(s) == wanted]
        owner.update({id(h): name for h in hits if h is not definition})
    counts: dict[str, int] = {}
    for name in owner.values():
        counts[name] = counts.get(name, 0) + 1
    return counts
