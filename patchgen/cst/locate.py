"""Find a patch's scope and its anchor inside it.

Anchors are compared on *normalized* code (`ast.unparse` of the parsed text), so whitespace, line breaks,
comments, redundant parentheses and trailing commas never matter, while any change of meaning does.
A compound statement (if/for/with/...) is matched on its header, written with a trailing colon.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

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


def find_scope(module: cst.Module, scope: str) -> cst.Module | cst.ClassDef | cst.FunctionDef:
    """`<module>`, a top-level `Name`, or a dotted path such as `Class.method`."""
    return scope_chain(module, scope)[-1]


def scope_chain(module: cst.Module, scope: str) -> list[cst.CSTNode]:
    """The module and each definition on the way down to `scope`."""
    chain: list[cst.CSTNode] = [module]
    if scope == "<module>":
        return chain
    node: cst.CSTNode = module
    for depth, part in enumerate(scope.split(".")):
        body = _body_of(node)
        matches = [s for s in body if isinstance(s, cst.ClassDef | cst.FunctionDef) and s.name.value == part]
        if len(matches) != 1:
            names = [s.name.value for s in body if isinstance(s, cst.ClassDef | cst.FunctionDef)]
            prefix = ".".join(scope.split(".")[:depth])
            near = difflib.get_close_matches(part, names, n=5, cutoff=0.5)
            candidates = [(f"{prefix}.{n}" if prefix else n, _named(body, n)) for n in near]
            what = "no definition" if not matches else f"{len(matches)} definitions"
            raise LocateError(
                f"scope {scope!r}: {what} named {part!r} in {prefix or 'the module'}",
                candidates,
                SCOPE_AMBIGUOUS if matches else SCOPE_MISSING,
            )
        node = matches[0]
        chain.append(node)
    return chain


def _named(body: list[cst.CSTNode], name: str) -> cst.CSTNode:
    return next(s for s in body if isinstance(s, cst.ClassDef | cst.FunctionDef) and s.name.value == name)


def _body_of(node: cst.CSTNode) -> list[cst.CSTNode]:
    if isinstance(node, cst.Module):
        return list(node.body)
    body = getattr(node, "body", None)
    return list(body.body) if isinstance(body, cst.BaseSuite) and hasattr(body, "body") else []


def iter_statements(node: cst.CSTNode) -> Iterator[cst.BaseStatement]:
    """Every statement inside `node`'s body, depth first, in source order (nested blocks included)."""
    for child in child_nodes(node):
        if isinstance(child, cst.BaseStatement):
            yield child
        if not isinstance(child, cst.BaseExpression):
            yield from iter_statements(child)


@dataclass(frozen=True)
class Match:
    node: cst.CSTNode
    normalized: str


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
    """`_unique` over statements, keying (printing and re-parsing) only those of the anchor's kind: a statement of
    another kind cannot match. On a miss every statement is keyed, for the nearest candidates."""
    shape = _anchor_shape(wanted)
    same = [s for s in statements if (kind := statement_shape(s)) is None or kind == shape]
    try:
        return _unique(wanted, anchor, scope, [(s, index.statement_key) for s in same], "statement")
    except LocateError as exc:
        if exc.kind != ANCHOR_MOVED or len(same) == len(statements):
            raise
        keyed = [(s, index.statement_key(s)) for s in statements]
        raise LocateError(exc.message, _nearest(wanted, keyed), ANCHOR_MOVED) from None


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
    quick = _quick_key(parsed)
    nodes = [n for n in index.of_type(scope_node, type(parsed)) if quick is None or _quick_key(n) == quick]
    try:
        return _unique(wanted, anchor, scope, [(n, _expression_key) for n in nodes], "expression")
    except LocateError as exc:
        if exc.kind != ANCHOR_MOVED or exc.candidates:
            raise
        # the quick key filtered every node out: the nearest candidates come from the expressions anchors are
        # usually written as (names, attributes, calls) and those of the anchor's own type
        kinds = dict.fromkeys((type(parsed), cst.Name, cst.Attribute, cst.Call))
        wider = [n for kind in kinds for n in index.of_type(scope_node, kind)]
        raise LocateError(
            exc.message, _nearest(wanted, [(n, _expression_key(n)) for n in wider]), ANCHOR_MOVED
        ) from None


def _expression_key(node: cst.CSTNode) -> str | None:
    return normalize(code_of(node), "eval")


def scopes_matching(module: cst.Module, anchor: str, expression: bool) -> list[tuple[str, cst.CSTNode]]:
    """(`Class.method` scope, first matching node) of every function or method where `anchor` matches: the hint
    for an anchor written under the wrong scope. A match inside a nested function is named by the innermost one."""
    wanted = normalize(anchor, mode="eval") if expression else normalize_anchor(anchor)
    if wanted is None:
        return []
    parsed = cst.parse_expression(anchor.strip()) if expression else None
    index = NodeIndex()
    found: dict[int, tuple[str, cst.CSTNode]] = {}
    for name, definition in _definitions(module, ""):
        if expression:
            kind, quick = type(parsed), _quick_key(parsed)
            nodes = [n for n in index.of_type(definition, kind) if quick is None or _quick_key(n) == quick]
            hits = [n for n in nodes if _expression_key(n) == wanted]
        else:
            hits = [n for n in index.statements(definition) if index.statement_key(n) == wanted]
        for hit in hits:  # definitions come outermost first: an inner one overwrites its parent's claim
            found[id(hit)] = (name, hit)
    first: dict[str, cst.CSTNode] = {}
    for name, node in found.values():
        first.setdefault(name, node)
    return list(first.items())


def _definitions(node: cst.CSTNode, prefix: str) -> Iterator[tuple[str, cst.FunctionDef]]:
    """Every function (`f`, `Class.method`, `Class.Inner.method`, `f.inner`) below `node`, outermost first."""
    for child in _body_of(node):
        if isinstance(child, cst.ClassDef | cst.FunctionDef):
            name = f"{prefix}{child.name.value}"
            if isinstance(child, cst.FunctionDef):
                yield name, child
            yield from _definitions(child, name + ".")


def _quick_key(node: cst.CSTNode) -> str | None:
    """A cheap exact key for names, dotted names and calls of them; None means "compare normalized code"."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = _quick_key(node.value)
        return None if base is None or base.endswith("(") else f"{base}.{node.attr.value}"
    if isinstance(node, cst.Call):
        callee = _quick_key(node.func)
        return None if callee is None else f"{callee}("
    return None


def _unique(wanted: str, anchor: str, scope: str, pairs, what: str):
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
    raise LocateError(f"anchor {anchor!r} matches no {what} in scope {scope!r}", _nearest(wanted, keyed), ANCHOR_MOVED)


def _nearest(wanted: str, keyed: list[tuple[cst.CSTNode, str | None]]) -> list[tuple[str, cst.CSTNode]]:
    """The three nodes whose texts are closest to `wanted` (a text that occurs twice may be two of them)."""
    nodes: dict[str, list[cst.CSTNode]] = {}
    for node, text in keyed:
        if text:
            nodes.setdefault(text, []).append(node)
    texts = [text for _, text in keyed if text]
    return [(text, nodes[text].pop(0)) for text in difflib.get_close_matches(wanted, texts, n=3, cutoff=0.4)]
