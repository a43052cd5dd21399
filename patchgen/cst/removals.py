"""No silent deletion: every upstream statement a replacing patch removes must be accounted for.

A replaced region (`replace` of one statement or an `anchor` .. `through` run, `replace_method`,
`replace_definition`) is walked statement by statement, nested blocks included (a compound statement counts by its
header, and each statement of its blocks counts on its own: a softcap inside an `if` is not hidden by the `if`).
Each must match an entry of the template's `reimplements` (a conditional entry only when the patch sets its
variable) or of the patch's `removes` (`patchgen.accounting`); docstrings and `pass` carry no computation and are
not counted. Otherwise regen fails with one line per unaccounted statement, naming its first upstream line and the
template variable that would make the template re-implement it, or else `removes`.
"""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from patchgen.accounting import Reimplemented, matches, substitute
from patchgen.cst.locate import code_of, iter_statements, normalize, statement_key
from patchgen.cst.plan import Plan
from patchgen.errors import PatchgenError
from patchgen.ops.base import Edit
from patchgen.spec import Patch


def _texts(stmt: cst.BaseStatement) -> Iterator[tuple[cst.CSTNode, str]]:
    """(node, normalized one-line text) of a statement: each small statement of a line, or a compound header."""
    if isinstance(stmt, cst.SimpleStatementLine):
        for small in stmt.body:
            if isinstance(small, cst.Pass):
                continue
            if isinstance(small, cst.Expr) and isinstance(small.value, cst.SimpleString | cst.ConcatenatedString):
                continue  # a docstring
            text = normalize(code_of(small))
            yield small, (text if text is not None else code_of(small).strip())
    else:
        key = statement_key(stmt)
        yield stmt, (key.split("\n")[0] if key else code_of(stmt).strip().split("\n")[0])


def replaced_statements(edit: Edit) -> list[tuple[cst.CSTNode, str]]:
    """Every statement the edit removes from upstream, in source order (a definition's body for the definition
    ops: its header is what the op replaces by name)."""
    out: list[tuple[cst.CSTNode, str]] = []
    if isinstance(edit.target, cst.FunctionDef | cst.ClassDef):
        for stmt in iter_statements(edit.target):
            out += _texts(stmt)
        return out
    for node in (edit.target, *edit.span):
        for stmt in (node, *iter_statements(node)):
            out += _texts(stmt)
    return out


def _active(patch: Patch, entry: Reimplemented) -> bool:
    if entry.when_set is None:
        return True
    var = patch.template.var(entry.when_set)
    return var is not None and entry.when_set in patch.vars and patch.vars[entry.when_set] != var.default


def _hint(patch: Patch, text: str) -> str:
    for entry in patch.template.reimplements:
        if not _active(patch, entry) and matches(entry.start, text):
            var = patch.template.var(entry.when_set)
            return (
                f"set vars.{entry.when_set} ({var.doc}) so that the template re-implements it, or, if dropping it is "
                f"right, add it to the patch's removes"
            )
    return f'if dropping it is right, add removes = ["{text}"] to the patch with a comment saying why'


def check_removals(where: str, plan: Plan, module: cst.Module, relpath: str, lines) -> None:
    """Raise PatchgenError listing every upstream statement a replacing patch removes unaccounted for, and every
    `removes` entry that matches nothing the patch replaces (stale after an upgrade); `lines(nodes)` gives the
    upstream line of each node (positions cost a pass over the module: computed only for an error)."""
    problems: list[tuple[Patch, cst.CSTNode | None, str]] = []
    for edit in plan.edits:
        if not edit.replaces_target:
            continue
        patch = edit.patch
        values = {
            v.name: v.prepare(patch.vars.get(v.name, v.default)) for v in patch.template.vars if not v.kind.is_list
        }
        active = [substitute(e.start, values) for e in patch.template.reimplements if _active(patch, e)]
        starts = active + list(patch.removes)
        statements = replaced_statements(edit)
        problems += [(patch, node, text) for node, text in statements if not any(matches(s, text) for s in starts)]
        for entry in patch.removes:
            if not any(matches(entry, text) for _, text in statements):
                problems.append((patch, None, entry))
    if not problems:
        return
    numbers = lines([node for _, node, _ in problems if node is not None])
    messages = []
    for patch, node, text in problems:
        if node is None:
            messages.append(
                f"{where}: {patch.label}: removes entry {text!r} matches no statement the patch replaces in "
                f"{patch.where}; drop it (upstream no longer has that statement there?)"
            )
            continue
        line = numbers.pop(0)
        first = code_of(node).strip().split("\n")[0]
        messages.append(
            f"{where}: {patch.label}: replacing it deletes upstream {relpath} line {line} `{first}` in "
            f"{patch.where}, which the template's reimplements does not account for: {_hint(patch, text)}"
        )
    raise PatchgenError("\n".join(messages))
