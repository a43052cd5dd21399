"""Reading an upstream modeling module's structure with libcst: classes, their methods, what a class builds in
`__init__` (`self.x = Cls(...)`), and the nodes of a scope. Read-only helpers for the recognisers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import libcst as cst

from patchgen.cst.locate import child_nodes, code_of
from patchgen.generate import parse_upstream, upstream_lines
from patchgen.upstream import UpstreamFile


def walk(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Every node below `node` (itself included), in source order."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(reversed(child_nodes(current)))


def dotted(node: cst.CSTNode) -> str | None:
    """`self.config._attn_implementation` for an Attribute chain of Names, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base is not None else None
    return None


@dataclass
class Module:
    """One parsed upstream module, its top-level classes and functions, and the file:line of any node."""

    upstream: UpstreamFile
    tree: cst.Module = field(init=False)
    classes: dict[str, cst.ClassDef] = field(init=False)

    def __post_init__(self) -> None:
        self.tree = parse_upstream(self.upstream)
        self.classes = {s.name.value: s for s in self.tree.body if isinstance(s, cst.ClassDef)}

    def where(self, node: cst.CSTNode) -> str:
        """`transformers/models/x/modeling_x.py:123`: where a comment says a structure was found."""
        return f"{self.upstream.relpath}:{upstream_lines(self.tree, [node])[0]}"

    def method(self, cls: str, name: str) -> cst.FunctionDef | None:
        node = self.classes.get(cls)
        if node is None:
            return None
        found = [s for s in node.body.body if isinstance(s, cst.FunctionDef) and s.name.value == name]
        return found[0] if found else None

    def class_attr(self, cls: str, name: str) -> str | None:
        """The code of a class-level assignment `name = value` (e.g. `_supports_sdpa = False`)."""
        node = self.classes.get(cls)
        for stmt in node.body.body if node is not None else ():
            if isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    if isinstance(small, cst.Assign) and any(dotted(t.target) == name for t in small.targets):
                        return code_of(small.value)
        return None

    def built(self, cls: str) -> list[tuple[str, str]]:
        """(attribute, class) for every `self.attr = Cls(...)` in `cls.__init__` (branches included), and
        `self.attr = nn.ModuleList([Cls(...) for ...])` as (attr, Cls): the submodules a class may hold."""
        init = self.method(cls, "__init__")
        out: list[tuple[str, str]] = []
        for node in walk(init) if init is not None else ():
            if not isinstance(node, cst.Assign) or len(node.targets) != 1:
                continue
            target = dotted(node.targets[0].target)
            if target is None or not target.startswith("self.") or target.count(".") != 1:
                continue
            for inner in walk(node.value):
                if isinstance(inner, cst.Call) and dotted(inner.func) in self.classes:
                    out.append((target[5:], dotted(inner.func)))
                    break
        return out

    def paths(self, root: str) -> dict[str, list[str]]:
        """class -> the attribute paths from `root` to its instances (breadth first, each class once)."""
        found: dict[str, list[str]] = {}
        queue = [(root, "")]
        while queue:
            cls, prefix = queue.pop(0)
            for attr, sub in self.built(cls):
                path = f"{prefix}{attr}"
                if sub not in found:
                    found[sub] = [path]
                    queue.append((sub, path + "."))
                elif path not in found[sub]:
                    found[sub].append(path)
        return found


def nodes(scope: cst.CSTNode | None, keep: Callable[[cst.CSTNode], bool]) -> list[cst.CSTNode]:
    return [n for n in walk(scope) if keep(n)] if scope is not None else []


def parents(scope: cst.CSTNode) -> dict[int, cst.CSTNode]:
    """id(child) -> parent, for every node below `scope`."""
    out: dict[int, cst.CSTNode] = {}
    for node in walk(scope):
        for child in child_nodes(node):
            out[id(child)] = node
    return out
