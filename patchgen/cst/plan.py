"""Resolve every patch of a spec to the upstream node it edits, before anything is edited.

Resolving first means errors name upstream lines, a patch can never anchor on code another patch wrote,
and the rewrite itself is a single pass keyed by node identity. Each patch resolves on its own (its operation's
`resolve`, `patchgen/ops/`), so `resolve_each` can report every patch that does not apply (`patchgen upgrade`)
where `resolve` stops at the first.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from patchgen.cst.locate import LocateError, NodeIndex
from patchgen.ops import OPS
from patchgen.ops.base import (  # noqa: F401  (re-exported: the kinds name why a patch does not apply)
    ANCHOR_AMBIGUOUS,
    ANCHOR_MOVED,
    CONFLICT,
    INVALID_ANCHOR,
    KINDS,
    RENDER_ERROR,
    SCOPE_AMBIGUOUS,
    SCOPE_MISMATCH,
    SCOPE_MISSING,
    SPEC_ERROR,
    Edit,
    PlanError,
    Resolution,
    ResolveContext,
)
from patchgen.spec import Patch


@dataclass
class Plan(Resolution):
    """Every applying patch's resolution, merged in patch order."""

    def absorb(self, part: Resolution) -> None:
        self.edits += part.edits
        self.imports += [line for line in part.imports if line not in self.imports]
        self.renames.update(part.renames)
        self.added_names |= part.added_names
        self.rendered += part.rendered
        for index, codes in part.rendered_by.items():
            self.rendered_by.setdefault(index, []).extend(codes)
        self.chain_ids |= part.chain_ids
        self.path_ids |= part.path_ids

    def by_target(self) -> dict[int, list[Edit]]:
        table: dict[int, list[Edit]] = {}
        for edit in self.edits:
            table.setdefault(id(edit.target), []).append(edit)
        return table


def resolve(module: cst.Module, patches: tuple[Patch, ...]) -> Plan:
    """The plan of every patch; raises the first PlanError (in patch order; conflicts after the rest)."""
    plan, errors = resolve_each(module, patches)
    if errors:
        raise errors[0]
    return plan


def resolve_each(module: cst.Module, patches: tuple[Patch, ...]) -> tuple[Plan, list[PlanError]]:
    """Resolve every patch independently: the plan of the patches that apply, and one error per patch that does
    not (resolution failures in patch order, then conflicts). A failing patch leaves no trace in the plan."""
    index = NodeIndex()
    parts: dict[int, Resolution] = {}
    errors: list[PlanError] = []
    for patch in patches:
        try:
            parts[patch.index] = resolve_one(module, patch, index)
        except LocateError as exc:
            errors.append(PlanError(patch, exc.message, exc.candidates, exc.kind))
        except PlanError as exc:
            errors.append(exc)
    errors += _conflicts([edit for part in parts.values() for edit in part.edits])
    failed = {error.patch.index for error in errors}
    plan = Plan()
    for patch in patches:
        if patch.index not in failed:
            plan.absorb(parts[patch.index])
    return plan, errors


def resolve_one(module: cst.Module, patch: Patch, index: NodeIndex) -> Resolution:
    """One patch's edits, rendered code and imports; the paths down to its edits, which the rewrite visits."""
    out = Resolution(imports=list(dict.fromkeys(patch.template.imports)))
    ctx = ResolveContext(module, index, patch, out, scope=module)
    OPS[patch.template.op].resolve(ctx)
    for edit in out.edits:
        for node in (edit.target, *edit.span):
            out.path_ids.update(id(n) for n in index.path(ctx.scope, node))
    return out


def _conflicts(edits: list[Edit]) -> list[PlanError]:
    """A node edited by one patch must not sit inside a node another patch replaces wholesale.

    The earlier replacing patch wins: one error per later patch that edits inside it (a patch found in conflict
    replaces nothing itself)."""
    errors: dict[int, PlanError] = {}
    for outer in edits:
        if not outer.replaces_target or outer.patch.index in errors:
            continue
        inside = {id(n) for node in (outer.target, *outer.span) for n in _subtree(node)} - {id(outer.target)}
        for edit in edits:
            same = edit.target is outer.target and edit.where not in ("before", "after")
            if (
                edit.patch.index != outer.patch.index
                and edit.patch.index not in errors
                and (id(edit.target) in inside or same)
            ):
                errors[edit.patch.index] = PlanError(
                    edit.patch,
                    f"conflicts with patch {outer.patch.index} ({outer.patch.template.name}), which "
                    f"replaces the code this patch edits; merge them or re-anchor",
                    kind=CONFLICT,
                )
    return list(errors.values())


def _subtree(node: cst.CSTNode):
    yield node
    for child in node.children:
        yield from _subtree(child)
