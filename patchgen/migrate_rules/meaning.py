"""Rule 1's notion of "the same meaning": two statements equal once formatting, typing aliases and call
arguments are set aside (the arguments are then paired, so a template variable can follow its argument)."""

from __future__ import annotations

import ast
import copy

_TYPING_BUILTINS = {"List", "Dict", "Tuple", "Set", "FrozenSet", "Type"}


# ---- rule 1: what "the same meaning" is ---------------------------------------------------------------------


class _Canonical(ast.NodeTransformer):
    """Spellings upstream rewrites without changing meaning: Optional[X] -> X | None, Union[A, B] -> A | B,
    typing.List[...] (Dict, Tuple, Set, FrozenSet, Type) -> list[...]."""

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        node = self.generic_visit(node)
        name = ast.unparse(node.value)
        base = name.removeprefix("typing.")
        if "." in base:
            return node
        if base == "Optional":
            return ast.BinOp(node.slice, ast.BitOr(), ast.Constant(None))
        if base == "Union":
            parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            out = parts[0]
            for part in parts[1:]:
                out = ast.BinOp(out, ast.BitOr(), part)
            return out
        if base in _TYPING_BUILTINS:
            node.value = ast.Name(base.lower(), ast.Load())
        return node


def canonical(code: str) -> str:
    return ast.unparse(_Canonical().visit(ast.parse(code)))


def _chain(expr: ast.expr) -> list[ast.Call]:
    """The calls along a callee chain, outermost first: `torch.cat(a).to(b)` -> [.to(b), torch.cat(a)]."""
    calls, node = [], expr
    while isinstance(node, ast.Call | ast.Attribute):
        if isinstance(node, ast.Call):
            calls.append(node)
            node = node.func
        else:
            node = node.value
    return calls


def _skeleton(expr: ast.expr) -> str:
    """The callee chain without its arguments: `torch.cat(a, dim=0).to(b)` -> `torch.cat().to()`."""
    bare = copy.deepcopy(expr)
    for call in _chain(bare):
        call.args, call.keywords = [], []
    return ast.unparse(bare)


def _argument_pairs(old: ast.Call, new: ast.Call) -> list[tuple[str, str]] | None:
    """(old, new) text of every argument that changed, matched by position and keyword; None when they cannot be
    matched (a different number of positional arguments, or other keywords)."""
    if len(old.args) != len(new.args) or [k.arg for k in old.keywords] != [k.arg for k in new.keywords]:
        return None
    olds, news = [*old.args, *(k.value for k in old.keywords)], [*new.args, *(k.value for k in new.keywords)]
    pairs = zip(olds, news, strict=True)
    return [(ast.unparse(a), ast.unparse(b)) for a, b in pairs if ast.unparse(a) != ast.unparse(b)]


def same_meaning(old: str, new: str) -> tuple[str, list[tuple[str, str]] | None] | None:
    """Why two normalized statements mean the same (and the call arguments that changed), or None.

    Equal after `canonical`; or both a single assignment of the same kind to the same targets from a call with the
    same callee chain, where only arguments differ. Anything else (another callee, another target, a compound
    header that changed) is not the same meaning."""
    if canonical(old) == canonical(new):
        return "equal after normalising formatting and typing spellings", []
    a, b = ast.parse(old).body, ast.parse(new).body
    if len(a) != 1 or len(b) != 1 or type(a[0]) is not type(b[0]):
        return None
    a, b = a[0], b[0]
    if not isinstance(a, ast.Assign | ast.AnnAssign | ast.AugAssign) or not isinstance(a.value, ast.Call):
        return None
    if not isinstance(b.value, ast.Call) or targets_of(a) != targets_of(b) or _skeleton(a.value) != _skeleton(b.value):
        return None
    pairs: list[tuple[str, str]] | None = []
    for x, y in zip(_chain(a.value), _chain(b.value), strict=True):
        more = _argument_pairs(x, y)
        pairs = None if more is None or pairs is None else pairs + more
    return f"same targets and callee `{_skeleton(b.value)}`, only call arguments changed", pairs


def targets_of(stmt: ast.stmt) -> str:
    """What a statement assigns to: its targets, an augmented one's operator, an annotated one's annotation."""
    if isinstance(stmt, ast.Assign):
        return " = ".join(canonical(ast.unparse(t)) for t in stmt.targets)
    if isinstance(stmt, ast.AugAssign):
        return canonical(ast.unparse(stmt.target)) + type(stmt.op).__name__
    return canonical(ast.unparse(stmt.target)) + ": " + canonical(ast.unparse(stmt.annotation))
