"""Statement anchors: the one statement of a scope an anchor names (`before`, `after`, `anchor`), and the run of
sibling statements from `anchor` through `through`.

A compound statement is matched on its header; an anchor is compared only with statements of its kind (`ast`
class names), since keying a statement prints and re-parses it. Apart from expression anchors
(`patchgen.cst.expression_anchors`), which match nodes inside statements by another key.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

import libcst as cst

from patchgen.cst.locate import (
    ANCHOR_MOVED,
    INVALID_ANCHOR,
    LocateError,
    NodeIndex,
    child_nodes,
    nearest,
    normalize_anchor,
    unique_match,
)


def find_statement(
    scope_node: cst.CSTNode, anchor: str, scope: str, index: NodeIndex | None = None
) -> cst.BaseStatement:
    wanted = normalize_anchor(anchor)
    if wanted is None:
        raise LocateError(
            f"anchor {anchor!r} is not a Python statement (a compound header ends with ':')", [], INVALID_ANCHOR
        )
    index = index or NodeIndex()
    return _unique_statement(wanted, anchor, scope, index.statements(scope_node), index)


def find_statement_range(
    scope_node: cst.CSTNode, anchor: str, through: str, scope: str, index: NodeIndex | None = None
) -> list[cst.BaseStatement]:
    """The run of sibling statements from `anchor` to `through` (inclusive), in one block.

    `anchor` must be unique in the scope; `through` must match exactly once among the statements that follow
    `anchor` in its block (so a common statement such as `if labels is not None:` can end a run).
    """
    index = index or NodeIndex()
    first = find_statement(scope_node, anchor, scope, index)
    block = next(b for b in _blocks(scope_node) if any(s is first for s in b))
    following = block[next(i for i, s in enumerate(block) if s is first) :]
    wanted = normalize_anchor(through)
    if wanted is None:
        raise LocateError(
            f"'through' {through!r} is not a Python statement (a compound header ends with ':')", [], INVALID_ANCHOR
        )
    try:
        last = _unique_statement(wanted, through, scope, following, index)
    except LocateError as exc:
        raise LocateError(
            exc.message.replace(f"anchor {through!r}", f"'through' {through!r}", 1)
            + f" after 'anchor' {anchor!r} in the same block",
            exc.candidates,
            exc.kind,
        ) from None
    return following[: next(i for i, s in enumerate(following) if s is last) + 1]


def _unique_statement(
    wanted: str, anchor: str, scope: str, statements: list[cst.BaseStatement], index: NodeIndex
) -> cst.BaseStatement:
    """`unique_match` over statements, keying (printing and re-parsing) only those of the anchor's kind: a statement
    of another kind cannot match. On a miss every statement is keyed, for the nearest candidates."""
    shape = _anchor_shape(wanted)
    same = [s for s in statements if (kind := statement_shape(s)) is None or kind == shape]
    try:
        return unique_match(wanted, anchor, scope, [(s, index.statement_key) for s in same], "statement")
    except LocateError as exc:
        if exc.kind != ANCHOR_MOVED or len(same) == len(statements):
            raise
        keyed = [(s, index.statement_key(s)) for s in statements]
        raise LocateError(exc.message, nearest(wanted, keyed), ANCHOR_MOVED) from None


# libcst statement classes whose `ast` class has another name (asynchronous variants are handled apart)
_AST_NAMES = {"Del": "Delete"}


def statement_shape(stmt: cst.BaseStatement) -> tuple[str, ...] | None:
    """The `ast` class names of a statement (one per small statement of a line), as `ast.parse` of its normalized
    text gives them; None when unsure (such a statement is always compared)."""
    if isinstance(stmt, cst.SimpleStatementLine | cst.SimpleStatementSuite):
        return tuple(_AST_NAMES.get(type(small).__name__, type(small).__name__) for small in stmt.body)
    name = type(stmt).__name__
    if name not in ("If", "For", "While", "With", "Try", "TryStar", "FunctionDef", "ClassDef", "Match"):
        return None
    asynchronous = getattr(stmt, "asynchronous", None) is not None
    return (f"Async{name}" if asynchronous else name,)


def _anchor_shape(normalized: str) -> tuple[str, ...]:
    return tuple(type(node).__name__ for node in ast.parse(normalized).body)


def _blocks(node: cst.CSTNode) -> Iterator[list[cst.BaseStatement]]:
    """Every statement list (module body, indented block) inside `node`."""
    if isinstance(node, cst.Module | cst.IndentedBlock):
        yield list(node.body)
    for child in child_nodes(node):
        if not isinstance(child, cst.BaseExpression):
            yield from _blocks(child)
