"""What finding a scope or an anchor shares: the normalized code anchors are compared on, the walk over the nodes
that can hold one, and how a miss fails (`LocateError`, with the nearest candidates).

Anchors are compared on *normalized* code (`ast.unparse` of the parsed text), so whitespace, line breaks,
comments, redundant parentheses and trailing commas never matter, while any change of meaning does.
A compound statement (if/for/with/...) is matched on its header, written with a trailing colon. The finders are
`patchgen.cst.scopes` (a patch's scope), `patchgen.cst.statement_anchors` and `patchgen.cst.expression_anchors`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
from collections.abc import Callable, Iterator

import libcst as cst

_EMPTY = cst.Module(body=[])
_PASS_BLOCK = cst.IndentedBlock(body=[cst.SimpleStatementLine(body=[cst.Pass()])])


# LocateError.kind: what failed to match. These are the words of the `patchgen upgrade` status column.
SCOPE_MISSING = "scope missing"  # no definition named like a part of the scope
SCOPE_AMBIGUOUS = "scope ambiguous"  # several definitions with that name
ANCHOR_MOVED = "anchor moved"  # the anchor matches nothing in its scope (the nearest candidates are given)
ANCHOR_AMBIGUOUS = "anchor ambiguous"  # the anchor matches several times
INVALID_ANCHOR = "invalid anchor"  # the anchor text is not a statement / expression: a spec error


class LocateError(Exception):
    """An anchor or scope that matched zero or several times; `candidates` are the nearest matches."""

    def __init__(self, message: str, candidates: list[tuple[str, cst.CSTNode]], kind: str) -> None:
        super().__init__(message)
        self.message = message
        self.candidates = candidates
        self.kind = kind


def code_of(node: cst.CSTNode) -> str:
    return _EMPTY.code_for_node(node)


def normalize(code: str, mode: str = "exec") -> str | None:
    """Canonical text of a statement or expression, or None when the text does not parse on its own."""
    try:
        return ast.unparse(ast.parse(code.strip() if mode == "eval" else code, mode=mode))
    except SyntaxError:
        return None


def normalize_anchor(anchor: str) -> str | None:
    text = anchor.strip()
    if text.endswith(":"):  # a compound-statement header
        text += "\n    pass"
        if text[:3] == "try" and text[3:].lstrip().startswith(":"):  # `try:` parses only with a handler
            text += "\nexcept:\n    pass"
    return normalize(text)


def statement_key(stmt: cst.BaseStatement) -> str | None:
    """Normalized text of a statement; a compound statement is represented by its header alone."""
    if isinstance(stmt, cst.BaseCompoundStatement):
        changes = {"body": _PASS_BLOCK}
        for attr in ("orelse", "finalbody"):
            if getattr(stmt, attr, None) is not None:
                changes[attr] = None
        if isinstance(stmt, cst.Try):
            changes["handlers"] = [cst.ExceptHandler(body=_PASS_BLOCK)]
        stmt = stmt.with_changes(leading_lines=[], **changes)
        if isinstance(stmt, cst.FunctionDef | cst.ClassDef):
            stmt = stmt.with_changes(decorators=[])
    return normalize(code_of(stmt))


def iter_statements(node: cst.CSTNode) -> Iterator[cst.BaseStatement]:
    """Every statement inside `node`'s body, depth first, in source order (nested blocks included)."""
    for child in child_nodes(node):
        if isinstance(child, cst.BaseStatement):
            yield child
        if not isinstance(child, cst.BaseExpression):
            yield from iter_statements(child)


# Fields that only ever hold whitespace, comments, brackets and punctuation: no statement or expression lives there,
# so walks that look for statements, expressions or their ancestors skip them (most of a tree's nodes are trivia).
_TRIVIA_FIELDS = frozenset(
    {
        "asynchronous",
        "colon",
        "comma",
        "dot",
        "equal",
        "footer",
        "header",
        "lbrace",
        "lbracket",
        "leading_lines",
        "lines_after_decorators",
        "lpar",
        "operator",
        "rbrace",
        "rbracket",
        "rpar",
        "semicolon",
        "trailing_whitespace",
    }
)


@functools.cache
def _field_names(kind: type) -> tuple[str, ...]:
    return tuple(
        f.name
        for f in dataclasses.fields(kind)
        if f.name not in _TRIVIA_FIELDS and not f.name.startswith("whitespace")
    )


def child_nodes(node: cst.CSTNode) -> list[cst.CSTNode]:
    """The children of `node` that can be or contain statements and expressions, in source order: like
    `node.children` without whitespace, comments and punctuation, and without libcst's visitor machinery."""
    out: list[cst.CSTNode] = []
    for name in _field_names(type(node)):
        value = getattr(node, name)
        if isinstance(value, cst.CSTNode):
            out.append(value)
        elif isinstance(value, list | tuple):
            out.extend(v for v in value if isinstance(v, cst.CSTNode))
    return out


class NodeIndex:
    """Nodes of a scope grouped by type, and their parents, built once per scope however many anchors use it; and
    the statements of a scope with their normalized keys, computed once however many anchors compare them (keying
    prints and re-parses the statement: the main cost of locating anchors)."""

    def __init__(self) -> None:
        self._by_scope: dict[int, tuple[cst.CSTNode, dict[type, list[cst.CSTNode]], dict[int, cst.CSTNode]]] = {}
        self._statements: dict[int, tuple[cst.CSTNode, list[cst.BaseStatement]]] = {}
        self._keys: dict[int, tuple[cst.BaseStatement, str | None]] = {}  # the node is kept so its id stays unique

    def statements(self, scope_node: cst.CSTNode) -> list[cst.BaseStatement]:
        """Every statement inside the scope, depth first, in source order (``iter_statements``)."""
        if id(scope_node) not in self._statements:
            found = [s for s in iter_statements(scope_node) if not isinstance(s, cst.Module)]
            self._statements[id(scope_node)] = (scope_node, found)
        return self._statements[id(scope_node)][1]

    def statement_key(self, stmt: cst.BaseStatement) -> str | None:
        """``statement_key(stmt)``, memoized by node identity."""
        if id(stmt) not in self._keys:
            self._keys[id(stmt)] = (stmt, statement_key(stmt))
        return self._keys[id(stmt)][1]

    def _index(self, scope_node: cst.CSTNode) -> tuple[dict[type, list[cst.CSTNode]], dict[int, cst.CSTNode]]:
        if id(scope_node) not in self._by_scope:
            groups: dict[type, list[cst.CSTNode]] = {}
            parents: dict[int, cst.CSTNode] = {}
            stack = [scope_node]
            while stack:
                node = stack.pop()
                for child in child_nodes(node):
                    parents[id(child)] = node
                    groups.setdefault(type(child), []).append(child)
                    stack.append(child)
            self._by_scope[id(scope_node)] = (scope_node, groups, parents)
        return self._by_scope[id(scope_node)][1:]

    def of_type(self, scope_node: cst.CSTNode, kind: type) -> list[cst.CSTNode]:
        return self._index(scope_node)[0].get(kind, [])

    def path(self, scope_node: cst.CSTNode, target: cst.CSTNode) -> list[cst.CSTNode]:
        """`target` and its ancestors up to `scope_node` (a top-level statement of a module needs no index)."""
        if target is scope_node:
            return [target]
        if isinstance(scope_node, cst.Module) and any(s is target for s in scope_node.body):
            return [target, scope_node]
        parents = self._index(scope_node)[1]
        chain = [target]
        while chain[-1] is not scope_node:
            chain.append(parents[id(chain[-1])])
        return chain


def unique_match(
    wanted: str,
    anchor: str,
    scope: str,
    pairs: list[tuple[cst.CSTNode, Callable[[cst.CSTNode], str | None]]],
    what: str,
) -> cst.CSTNode:
    """The one node whose key (each node with its key function) is `wanted`; otherwise a LocateError saying how many
    matched, with the ambiguous matches or the nearest candidates."""
    keyed = [(node, key(node)) for node, key in pairs]
    hits = [node for node, text in keyed if text == wanted]
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise LocateError(
            f"anchor {anchor!r} matches {len(hits)} {what}s in scope {scope!r}; make it unique "
            f"(a longer statement, or a narrower scope)",
            [(wanted, n) for n in hits],
            ANCHOR_AMBIGUOUS,
        )
    raise LocateError(f"anchor {anchor!r} matches no {what} in scope {scope!r}", nearest(wanted, keyed), ANCHOR_MOVED)


def nearest(wanted: str, keyed: list[tuple[cst.CSTNode, str | None]]) -> list[tuple[str, cst.CSTNode]]:
    """The three nodes whose texts are closest to `wanted` (a text that occurs twice may be two of them)."""
    nodes: dict[str, list[cst.CSTNode]] = {}
    for node, text in keyed:
        if text:
            nodes.setdefault(text, []).append(node)
    texts = [text for _, text in keyed if text]
    return [(text, nodes[text].pop(0)) for text in difflib.get_close_matches(wanted, texts, n=3, cutoff=0.4)]
