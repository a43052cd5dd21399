"""The two migration rules of `patchgen upgrade --migrate` (stated in patchgen/migrate.py and
docs/upgrading-transformers.md): what "the same meaning" is for a moved anchor, and when a scope rename is followed.
Each rule proposes `{spec key: new value}` with its reason, or says in one line why the patch is left to the human."""

from __future__ import annotations

import ast
import copy
import difflib

import libcst as cst

from patchgen.cst.locate import (
    ANCHOR_MOVED,
    SCOPE_MISSING,
    LocateError,
    NodeIndex,
    code_of,
    normalize,
    normalize_anchor,
)
from patchgen.cst.plan import PlanError
from patchgen.cst.scopes import find_scope
from patchgen.cst.statement_anchors import find_statement, statement_shape
from patchgen.generate import UnitSource
from patchgen.spec import Patch

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
    if not isinstance(b.value, ast.Call) or _targets(a) != _targets(b) or _skeleton(a.value) != _skeleton(b.value):
        return None
    pairs: list[tuple[str, str]] | None = []
    for x, y in zip(_chain(a.value), _chain(b.value), strict=True):
        more = _argument_pairs(x, y)
        pairs = None if more is None or pairs is None else pairs + more
    return f"same targets and callee `{_skeleton(b.value)}`, only call arguments changed", pairs


def _targets(stmt: ast.stmt) -> str:
    """What a statement assigns to: its targets, an augmented one's operator, an annotated one's annotation."""
    if isinstance(stmt, ast.Assign):
        return " = ".join(canonical(ast.unparse(t)) for t in stmt.targets)
    if isinstance(stmt, ast.AugAssign):
        return canonical(ast.unparse(stmt.target)) + type(stmt.op).__name__
    return canonical(ast.unparse(stmt.target)) + ": " + canonical(ast.unparse(stmt.annotation))


# ---- proposing ----------------------------------------------------------------------------------------------


def _failed_key(patch: Patch, scope: cst.CSTNode, index: NodeIndex) -> str:
    """Which anchor key of the patch no longer matches (`through` when only the end of its run moved)."""
    key = next(k for k in ("before", "after", "anchor") if getattr(patch, k))
    if patch.through is None or patch.template.op == "wrap":
        return key
    try:
        find_statement(scope, patch.anchor_text, patch.scope, index)
    except LocateError:
        return key
    return "through"


def _header(key: str) -> str:
    return key.splitlines()[0] if "\n" in key else key


def _anchor_rule(patch: Patch, module: cst.Module) -> tuple[dict[str, str], str] | str:
    """Rule 1: the edits (key -> new value) and the reason, or why the anchor is left to the human."""
    scope = find_scope(module, patch.scope)
    index = NodeIndex()
    key = _failed_key(patch, scope, index)
    old = getattr(patch, key)
    if patch.template.op == "wrap":
        wanted = normalize(old, "eval")
        pool = [(n, normalize(code_of(n), "eval")) for n in _expressions(scope, index)]
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
        return f"{key}: no statement of its kind has the same meaning (nearest `{_header(nearest)}`)"
    if len(fits) > 1:
        return f"{key}: {len(fits)} candidates are equally eligible: " + "; ".join(
            f"`{_header(t)}`" for _, t, *_ in fits
        )
    node, text, why, pairs = fits[0]
    rivals = [k for n, k in pool if n is not node and ratio[id(n)] >= ratio[id(node)] and k != text]
    if rivals:
        return f"{key}: `{_header(rivals[0])}` is as near as the eligible `{_header(text)}`"
    if sum(k == text for _, k in pool) > 1:
        return f"{key}: the eligible `{_header(text)}` occurs {sum(k == text for _, k in pool)} times in the scope"
    edits = {key: _header(text)}
    for old_arg, new_arg in pairs or []:
        for var in patch.template.vars:
            value = patch.vars.get(var.name, None if var.required else var.default)
            if var.kind.scalar == "expr" and isinstance(value, str) and normalize(value, "eval") == old_arg:
                edits[f"vars.{var.name}"] = new_arg
    follows = ", ".join(f"vars.{k.split('.', 1)[1]}" for k in edits if k.startswith("vars."))
    return edits, f"rule 1 (moved anchor): {why}" + (f"; {follows} follows the changed argument" if follows else "")


def _expressions(scope: cst.CSTNode, index: NodeIndex) -> list[cst.CSTNode]:
    kinds = (cst.Name, cst.Attribute, cst.Call, cst.BinaryOperation, cst.Subscript)
    return [n for kind in kinds for n in index.of_type(scope, kind)]


def _definitions(node: cst.CSTNode, prefix: str = ""):
    body = node.body if isinstance(node, cst.Module) else getattr(node.body, "body", ())
    for child in body:
        if isinstance(child, cst.ClassDef | cst.FunctionDef):
            yield prefix + child.name.value, child
            yield from _definitions(child, f"{prefix}{child.name.value}.")


def _holders(module: cst.Module, patch: Patch) -> dict[str, int]:
    """Every definition (innermost) holding a match of the unchanged anchor, with its number of matches."""
    text, wrap = patch.anchor_text, patch.template.op == "wrap"
    wanted = normalize(text, "eval") if wrap else normalize_anchor(text)
    index, owner = NodeIndex(), {}
    for name, definition in _definitions(module):  # outermost first: an inner definition overwrites its parent
        if wrap:
            hits = [n for n in _expressions(definition, index) if normalize(code_of(n), "eval") == wanted]
        else:
            hits = [s for s in index.statements(definition) if index.statement_key(s) == wanted]
        owner.update({id(h): name for h in hits if h is not definition})
    counts: dict[str, int] = {}
    for name in owner.values():
        counts[name] = counts.get(name, 0) + 1
    return counts


def _scope_rule(patch: Patch, module: cst.Module, old_module: cst.Module | None) -> tuple[dict[str, str], str] | str:
    """Rule 2: the new scope, or why the scope is left to the human."""
    if patch.anchor_text is None or patch.scope == "<module>":
        return "no anchor to follow to another scope"
    holders = {k: v for k, v in _holders(module, patch).items() if k != patch.scope}
    if len(holders) != 1:
        where = ", ".join(sorted(holders)) or "no definition"
        return f"scope {patch.scope} is gone; the unchanged anchor is in {where}, not in exactly one other definition"
    ((scope, count),) = holders.items()
    if count != 1:
        return f"scope: the unchanged anchor matches {count} times in {scope}"
    kind = type(find_scope(module, scope))
    if old_module is not None:
        try:
            if type(find_scope(old_module, patch.scope)) is not kind:
                return f"scope: {scope} is not the same kind of definition as {patch.scope}"
        except LocateError:
            pass
    qualified = f"{patch.module}:{scope}" if patch.module else scope
    return {"scope": qualified}, f"rule 2 (moved scope): the unchanged anchor matches once, only in `{scope}`"


def propose(error: PlanError, new: UnitSource, old: UnitSource | None) -> tuple[dict[str, str], str] | str:
    """The edits (spec key -> new value, in the spec's naming) that would make a failing patch apply, or why not."""
    patch = error.patch
    old_module = old.module if old is not None else None
    try:
        if error.kind == ANCHOR_MOVED:
            found = _anchor_rule(patch, new.module)
            if isinstance(found, str) and patch.anchor_text and patch.scope != "<module>":
                elsewhere = sorted(set(_holders(new.module, patch)) - {patch.scope})
                if elsewhere:  # a hint only: the scope still exists, so the code was refactored, not renamed
                    found += f"; the unchanged anchor is now in {', '.join(elsewhere)} (the old scope still exists)"
            return found
        if error.kind == SCOPE_MISSING:
            return _scope_rule(patch, new.module, old_module)
    except (LocateError, SyntaxError, cst.ParserSyntaxError) as exc:
        return f"cannot analyse: {getattr(exc, 'message', exc)}"
    return f"no migration rule for `{error.kind}`"


# ---- where a patch is written, and editing it in place --------------------------------------------------------
