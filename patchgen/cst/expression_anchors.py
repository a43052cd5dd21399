"""Expression anchors: the one expression of a scope a `wrap` patch names, compared on normalized code after a
cheap exact key (`quick_key`) for names, dotted names and calls; on a miss, the nearest expressions of the kinds
anchors are written as.

Apart from statement anchors (`patchgen.cst.statement_anchors`) because expressions are found among a scope's nodes
by type, not among its statements.
"""

from __future__ import annotations

import libcst as cst

from patchgen.cst.locate import (
    ANCHOR_MOVED,
    INVALID_ANCHOR,
    LocateError,
    NodeIndex,
    code_of,
    nearest,
    normalize,
    unique_match,
)


def find_expression(
    scope_node: cst.CSTNode, anchor: str, scope: str, index: NodeIndex | None = None
) -> cst.BaseExpression:
    wanted = normalize(anchor, mode="eval")
    try:
        parsed = cst.parse_expression(anchor.strip())
    except cst.ParserSyntaxError:
        wanted = None
    if wanted is None:
        raise LocateError(f"anchor {anchor!r} is not a Python expression", [], INVALID_ANCHOR)
    index = index or NodeIndex()
    quick = quick_key(parsed)
    nodes = [n for n in index.of_type(scope_node, type(parsed)) if quick is None or quick_key(n) == quick]
    try:
        return unique_match(wanted, anchor, scope, [(n, expression_key) for n in nodes], "expression")
    except LocateError as exc:
        if exc.kind != ANCHOR_MOVED or exc.candidates:
            raise
        # the quick key filtered every node out: the nearest candidates come from the expressions anchors are
        # usually written as (names, attributes, calls) and those of the anchor's own type
        kinds = dict.fromkeys((type(parsed), cst.Name, cst.Attribute, cst.Call))
        wider = [n for kind in kinds for n in index.of_type(scope_node, kind)]
        raise LocateError(
            exc.message, nearest(wanted, [(n, expression_key(n)) for n in wider]), ANCHOR_MOVED
        ) from None


def expression_key(node: cst.CSTNode) -> str | None:
    """The normalized text an expression anchor is compared with."""
    return normalize(code_of(node), "eval")


def quick_key(node: cst.CSTNode) -> str | None:
    """A cheap exact key for names, dotted names and calls of them; None means "compare normalized code"."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = quick_key(node.value)
        return None if base is None or base.endswith("(") else f"{base}.{node.attr.value}"
    if isinstance(node, cst.Call):
        callee = quick_key(node.func)
        return None if callee is None else f"{callee}("
    return None
