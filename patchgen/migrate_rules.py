"""The migration rules of `patchgen upgrade --migrate` (stated for users in docs/upgrading-transformers.md), each a
narrow statement of when a failing patch keeps its meaning on a new release:
1. a moved anchor: the same statement respelled, or the same assignment with other call arguments;
2. a renamed or moved scope: the unchanged anchor matches once, in one other definition of the same kind;
3. the same variable, bound by other code: an insert after an assignment, or a template re-implementing the whole
   `target =` statement, follows the (last, unbranched) statement binding the same targets;
4. a changed condition: an insert before/after a branch follows the only `if` testing one conjunct more or fewer;
5. code moved into the definition the old scope delegates to (`self.model = ThinkerModel(config)`, then
   `self.model(...)`): the unchanged anchor, or rule 1, 3 or 4, in exactly one delegate.
Each rule proposes `{spec key: new value}` with its reason, or says in one line why the patch is left to the human.
They live in this one front-end module (not one module each) because every other module of patchgen/ is hashed
into the generated files' headers (patchgen/provenance.py FRONT_ENDS): a new module would change every header."""

from __future__ import annotations

import ast
import copy
import difflib
import textwrap

import libcst as cst

from patchgen.accounting import matches, normalize_start, substitute
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


def _anchor_rule(patch: Patch, module: cst.Module, where: str | None = None) -> tuple[dict[str, str], str] | str:
    """Rule 1: the edits (key -> new value) and the reason, or why the anchor is left to the human. `where`: the
    scope to look in (rule 5 tries a delegate's method), the patch's own by default."""
    scope = find_scope(module, where or patch.scope)
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


# ---- rule 3: the same variable, bound by other code ---------------------------------------------------------


def _bound(text: str | None) -> str | None:
    """What a single plain or annotated assignment binds (its targets, the annotation left out), else None."""
    try:
        body = ast.parse(text).body if text else []
    except SyntaxError:
        return None
    if len(body) != 1 or not isinstance(body[0], ast.Assign | ast.AnnAssign) or body[0].value is None:
        return None
    targets = body[0].targets if isinstance(body[0], ast.Assign) else [body[0].target]
    return " = ".join(canonical(ast.unparse(t)) for t in targets)


def _binders(scope: cst.CSTNode, targets: str) -> tuple[list[str], bool]:
    """The statements binding `targets` in the scope (normalized, in source order), and whether they are all
    statements of the scope's own body (no branch or loop decides which binding holds)."""
    index = NodeIndex()
    found = [(s, k) for s in index.statements(scope) if (k := index.statement_key(s)) and _bound(k) == targets]
    top = {id(s) for s in getattr(getattr(scope, "body", None), "body", ())}
    return [k for _, k in found], all(id(s) in top for s, _ in found)


def _values(patch: Patch) -> dict[str, object]:
    return {v.name: patch.vars.get(v.name, None if v.required else v.default) for v in patch.template.vars}


def _rebound_rule(
    patch: Patch, module: cst.Module, old: cst.Module | None, where: str | None = None
) -> tuple[dict[str, str], str] | str | None:
    """Rule 3, or None when the anchor is no single assignment the rule speaks about. An `after` insert runs once
    its anchor's variables are bound; a `replace` whose template declares it re-implements `target =` rewrites the
    whole statement. Either keeps its meaning when upstream binds the same targets by other code (a tuple became a
    call, another callee), provided they are bound once in the scope, before and now (for an insert: the last
    binding, when every binding is a statement of the scope's own body, before and now)."""
    op, key = patch.template.op, ("after" if patch.after else "anchor")
    if (op, key) not in (("insert", "after"), ("replace", "anchor")) or patch.through is not None:
        return None
    targets = _bound(normalize_anchor(getattr(patch, key)))
    if targets is None:
        return None
    anchor = normalize_anchor(getattr(patch, key))
    new, flat = _binders(find_scope(module, where or patch.scope), targets)
    before, flat_before = _binders(find_scope(old, patch.scope), targets) if old is not None else ([], False)
    last = op == "insert" and flat and flat_before  # the value the code after reads: the last binding, both times
    if before != [anchor] and not (last and before[-1:] == [anchor]):
        return f"rule 3: `{targets}` was not bound once (or last, by the scope's own body) in the old scope"
    new = new[-1:] if last else new
    if len(new) != 1:
        return f"rule 3: `{targets}` is bound {len(new)} times in the scope"
    if op == "replace":
        values = _values(patch)
        starts = [normalize_start(substitute(r.start, values)) for r in patch.template.reimplements]
        if not any(matches(start, new[0]) and not start.endswith("(") for start in starts):
            return f"rule 3: the template does not declare it re-implements `{targets} =`"
    how = "the patch runs after it" if op == "insert" else "the template re-implements the whole statement"
    once = "last bound by the scope's own body" if last and len(before) + len(new) > 2 else "bound once"
    return {key: _header(new[0])}, f"rule 3 (same variable, other code): `{targets}` is {once}, as before; {how}"


# ---- rule 4: the same branch, under a condition that gained or lost a conjunct --------------------------------


def _conjuncts(text: str | None) -> frozenset[str] | None:
    try:
        body = ast.parse(text).body if text else []
    except SyntaxError:
        return None
    if len(body) != 1 or not isinstance(body[0], ast.If):
        return None
    test = body[0].test
    parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    return frozenset(canonical(ast.unparse(part)) for part in parts)


def _condition_rule(
    patch: Patch, module: cst.Module, where: str | None = None
) -> tuple[dict[str, str], str] | str | None:
    """Rule 4, or None when the anchor is no `if` header of a before/after insert. The insert stays before (after)
    the same branch when exactly one `if` of the scope tests the old conditions with one more or one fewer and-ed
    (`if pixel_values is not None:` -> `if mm_encoder_outputs.get('image') is None and pixel_values is not None:`)."""
    key = "before" if patch.before else "after"
    old = _conjuncts(normalize_anchor(getattr(patch, key) or ""))
    if patch.template.op != "insert" or old is None or patch.through is not None:
        return None
    scope, index = find_scope(module, where or patch.scope), NodeIndex()
    keys = [k for s in index.statements(scope) if (k := index.statement_key(s))]
    fits = sorted({k for k in keys if (c := _conjuncts(k)) is not None and (c < old or c > old)})
    if len(fits) != 1:
        return f"rule 4: {len(fits)} `if` headers test one conjunct more or fewer"
    if keys.count(fits[0]) != 1:
        return f"rule 4: `{_header(fits[0])}` occurs {keys.count(fits[0])} times in the scope"
    new = _conjuncts(fits[0])
    change = ", ".join([*(f"+ `{c}`" for c in sorted(new - old)), *(f"- `{c}`" for c in sorted(old - new))])
    why = f"rule 4 (changed condition): the only `if` of the scope testing the old conditions {change}"
    return {key: _header(fits[0])}, why


# ---- rule 5: code that moved into the definition the old scope delegates to ----------------------------------


def _delegates(module: cst.Module, scope: str) -> list[str]:
    """`D.m` (or `D` for a class scope `C`) for each attribute `self.a = D(...)` / `D._from_config(...)` that
    `C.__init__` binds to a class D of the module, when the new `C.m` calls `self.a(...)` (m = forward) or
    `self.a.m(...)`."""
    owner, _, method = scope.partition(".")
    try:
        init = find_scope(module, f"{owner}.__init__")
        body = find_scope(module, scope)
    except LocateError:
        return []
    classes = {c.name.value for c in module.body if isinstance(c, cst.ClassDef)}
    code, out = ast.parse(textwrap.dedent(code_of(body))) if method else None, []
    for node in ast.walk(ast.parse(textwrap.dedent(code_of(init)))):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and len(node.targets) == 1):
            continue
        attr, callee = ast.unparse(node.targets[0]), ast.unparse(node.value.func).removesuffix("._from_config")
        if not attr.startswith("self.") or callee not in classes or callee == owner:
            continue
        calls = {ast.unparse(c.func) for c in ast.walk(code) if isinstance(c, ast.Call)} if code else set()
        if method and not calls & {f"{attr}.{method}", *([attr] if method == "forward" else [])}:
            continue
        out.append(f"{callee}.{method}" if method else callee)
    return sorted(set(out))


def _delegate_rule(
    patch: Patch, module: cst.Module, old: cst.Module | None
) -> tuple[dict[str, str], str] | str | None:
    """Rule 5: the old scope still exists but its code now runs in the definition it delegates to; there the
    anchor matches unchanged, or by rule 1, 3 or 4. Exactly one delegate may fit."""
    key = "before" if patch.before else "after" if patch.after else "anchor"
    if patch.through is not None or patch.scope == "<module>":
        return None
    found: list[tuple[str, dict[str, str], str]] = []
    for where in _delegates(module, patch.scope):
        try:
            scope, index = find_scope(module, where), NodeIndex()
        except LocateError:
            continue
        wanted = normalize_anchor(getattr(patch, key))
        hits = [s for s in index.statements(scope) if index.statement_key(s) == wanted]
        if len(hits) == 1:
            found.append((where, {}, "the unchanged anchor matches once"))
            continue
        for rule in (_anchor_rule, _rebound_rule, _condition_rule):
            args = (patch, module, old, where) if rule is _rebound_rule else (patch, module, where)
            got = rule(*args)
            if isinstance(got, tuple):
                found.append((where, *got))
                break
    if len(found) != 1:
        return f"rule 5: {len(found)} delegate(s) of {patch.scope} hold the anchor" if found else None
    where, edits, why = found[0]
    scope = f"{patch.module}:{where}" if patch.module else where
    return {"scope": scope, **edits}, f"rule 5 (moved into the delegate `{where}`): {why}"


def propose(error: PlanError, new: UnitSource, old: UnitSource | None) -> tuple[dict[str, str], str] | str:
    """The edits (spec key -> new value, in the spec's naming) that would make a failing patch apply, or why not."""
    patch = error.patch
    old_module = old.module if old is not None else None
    try:
        if error.kind == ANCHOR_MOVED:
            found = _anchor_rule(patch, new.module)
            if isinstance(found, str):
                tried = [
                    _rebound_rule(patch, new.module, old_module),
                    _condition_rule(patch, new.module),
                    _delegate_rule(patch, new.module, old_module),
                ]
                done = [t for t in tried if isinstance(t, tuple)]
                if done:
                    return done[0]
                found = "; ".join([found, *(t for t in tried if isinstance(t, str))])
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
