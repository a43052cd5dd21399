"""A patch's scope: `<module>`, a top-level name or a dotted path such as `Class.method`, found by name in the
upstream module; and `scopes_matching`, the functions where an anchor written under the wrong scope does match.

Apart from the anchors (`patchgen.cst.statement_anchors`, `patchgen.cst.expression_anchors`) because a scope is found
by definition names, not by normalized code, and `patchgen upgrade` and `--migrate` look scopes up on their own.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator

import libcst as cst

from patchgen.cst.expression_anchors import expression_key, quick_key
from patchgen.cst.locate import SCOPE_AMBIGUOUS, SCOPE_MISSING, LocateError, NodeIndex, normalize, normalize_anchor


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
            kind, quick = type(parsed), quick_key(parsed)
            nodes = [n for n in index.of_type(definition, kind) if quick is None or quick_key(n) == quick]
            hits = [n for n in nodes if expression_key(n) == wanted]
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
