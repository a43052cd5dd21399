"""What a new release does to each patch: its status (where it applies now, or why it does not) and the region of
upstream it patches, old text against new.

Apart from the analysis (`patchgen.upgrade`), which runs the resolution and the build, because these are the findings
the report (`patchgen.report`) and `--migrate` read, one patch at a time.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import libcst as cst

from patchgen.config import ProjectConfig
from patchgen.cst.locate import LocateError, code_of, normalize
from patchgen.cst.plan import Edit, Plan, PlanError
from patchgen.cst.scopes import scope_chain
from patchgen.generate import _positions, candidate_lines
from patchgen.spec import Patch
from patchgen.upstream import UpstreamFile

APPLIED = "applied"
REPLACED_CHANGED = "replaced code changed"  # applies, but the upstream code it replaces is not what it was
APPLIES = (APPLIED, REPLACED_CHANGED)


@dataclass(frozen=True)
class PatchStatus:
    patch: Patch
    status: str  # APPLIED, REPLACED_CHANGED or a PlanError kind
    detail: str  # one line: where it applies now, or why it does not
    candidates: tuple[tuple[int, str], ...] = ()  # nearest upstream matches (line, text) when it does not apply
    scope: str = ""  # the scope named by its module (`attention_processor:Cls.fn`) when it edits a companion

    @property
    def applies(self) -> bool:
        return self.status in APPLIES


@dataclass(frozen=True)
class Region:
    """Old vs new upstream text of one patched scope."""

    scope: str
    old_lines: tuple[int, int] | None  # first and last upstream line
    new_lines: tuple[int, int] | None
    diff: str  # unified diff with upstream line numbers; "" when unchanged or a side is missing
    near: str = ""  # the scope is gone: the nearest definition, compared in its place


class UpstreamLines:
    """Upstream line numbers of one parsed module (positions resolved once, on first use, and shared with the
    error messages' candidate lines: ``generate._positions``, a second of codegen per big module)."""

    def __init__(self, module: cst.Module) -> None:
        self.module = module
        self._positions = None

    def span(self, node: cst.CSTNode) -> tuple[int, int]:
        if self._positions is None:
            self._positions = _positions(self.module)
        if isinstance(node, cst.Module):
            return 1, max(1, len(self.module.code.splitlines()))
        first = [self._positions[d].start.line for d in getattr(node, "decorators", ())]
        return min([*first, self._positions[node].start.line]), self._positions[node].end.line


def clean_message(config: ProjectConfig, message: str) -> str:
    """Messages name files by absolute path; the report is the same on every machine."""
    return message.replace(str(config.root) + os.sep, "")


def _edits_of(plan: Plan, patch: Patch) -> list[Edit]:
    return [e for e in plan.edits if e.patch.index == patch.index]


def _where(edit: Edit, lines: UpstreamLines) -> str:
    return "end of module" if edit.where == "end" else f"line {lines.span(edit.target)[0]}"


def _replaced_text(edit: Edit) -> str:
    return "\n".join(normalize(code_of(n).strip()) or code_of(n) for n in (edit.target, *edit.span))


def patch_status(
    patch: Patch,
    plan: Plan,
    old_plan: Plan,
    errors: list[PlanError],
    new_lines: UpstreamLines,
    old_lines: UpstreamLines | None,
    config: ProjectConfig,
) -> PatchStatus:
    """Where the patch applies on the new release (and where it was on the pinned one), or why it does not, with
    the nearest upstream candidates."""
    error = next((e for e in errors if e.patch.index == patch.index), None)
    if error is not None:
        candidates = tuple(candidate_lines(new_lines.module, error))
        detail = clean_message(config, error.message.splitlines()[0])
        if candidates:
            line, text = candidates[0]
            more = f" ({len(candidates) - 1} more)" if len(candidates) > 1 else ""
            detail = f"nearest: line {line} `{text}`{more}"
        return PatchStatus(patch, error.kind, detail, candidates)
    new_edit, old_edit = _edits_of(plan, patch)[0], next(iter(_edits_of(old_plan, patch)), None)
    where = _where(new_edit, new_lines)
    if old_edit is not None and old_lines is not None and _where(old_edit, old_lines) != where:
        where += f" (was {_where(old_edit, old_lines).removeprefix('line ')})"
    if new_edit.replaces_target and old_edit is not None and _replaced_text(old_edit) != _replaced_text(new_edit):
        return PatchStatus(
            patch,
            REPLACED_CHANGED,
            f"{where}; the upstream code it replaces changed: check the template still does what upstream now does",
        )
    return PatchStatus(patch, APPLIED, where)


def patch_regions(
    patches: tuple[Patch, ...],
    prefix: str,
    old: UpstreamFile | None,
    old_module: cst.Module | None,
    old_lines: UpstreamLines | None,
    old_plan: Plan,
    new: UpstreamFile,
    new_module: cst.Module,
    new_lines: UpstreamLines,
    plan: Plan,
) -> Iterator[Region]:
    """One region per patched scope (per anchored statement for `<module>` patches) of one unit's patches; a
    companion's scopes are named `<companion>:<scope>` (`prefix`)."""
    seen: set[str] = set()
    for patch in patches:
        if patch.scope == "<module>":
            if patch.anchor_text is None:
                continue
            key = f"<module>: {patch.anchor_text}"
            old_node = next((e.target for e in _edits_of(old_plan, patch)), None)
            new_node = next((e.target for e in _edits_of(plan, patch)), None)
            near = ""
        else:
            key = patch.scope
            old_node = _scope_node(old_module, patch.scope)[0] if old_module is not None else None
            new_node, near = _scope_node(new_module, patch.scope)
        if key in seen:
            continue
        seen.add(key)
        yield _region(prefix + key, old, old_node, old_lines, new, new_node, new_lines, near)


def _scope_node(module: cst.Module, scope: str) -> tuple[cst.CSTNode | None, str]:
    """The scope's definition; when it is gone, the nearest one (`ToyLayer.forward` -> `ToyDecoderLayer.forward`
    when the class was renamed) and its name; (None, "") when nothing is near."""
    wanted = scope
    for _ in scope.split("."):
        try:
            return scope_chain(module, wanted)[-1], ("" if wanted == scope else wanted)
        except LocateError as exc:
            if not exc.candidates:
                return None, ""
            near = exc.candidates[0][0]  # the dotted path down to the part that did not match, corrected
            wanted = ".".join([near, *wanted.split(".")[len(near.split(".")) :]])
    return None, ""


def _region(
    scope: str,
    old: UpstreamFile | None,
    old_node,
    old_lines: UpstreamLines | None,
    new: UpstreamFile,
    new_node,
    new_lines: UpstreamLines,
    near: str,
) -> Region:
    old_span = old_lines.span(old_node) if old_node is not None and old_lines is not None else None
    new_span = new_lines.span(new_node) if new_node is not None else None
    if old_span is None or new_span is None:
        return Region(scope, old_span, new_span, "", near)
    old_text = old.text.splitlines(keepends=True)[old_span[0] - 1 : old_span[1]]
    new_text = new.text.splitlines(keepends=True)[new_span[0] - 1 : new_span[1]]
    diff = difflib.unified_diff(
        old_text, new_text, fromfile=f"a/{old.relpath} ({old.pin})", tofile=f"b/{new.relpath} ({new.pin})"
    )
    lines = [_shift_hunk(line, old_span[0] - 1, new_span[0] - 1) for line in diff]
    return Region(
        scope, old_span, new_span, "".join(line if line.endswith("\n") else line + "\n" for line in lines), near
    )


_HUNK = re.compile(r"^@@ -(\d+)(,\d+)? \+(\d+)(,\d+)? @@")


def _shift_hunk(line: str, old_offset: int, new_offset: int) -> str:
    """Hunk headers count from the region's first line; make them upstream file line numbers."""
    match = _HUNK.match(line)
    if match is None:
        return line
    old_start, new_start = int(match.group(1)) + old_offset, int(match.group(3)) + new_offset
    return f"@@ -{old_start}{match.group(2) or ''} +{new_start}{match.group(4) or ''} @@" + line[match.end() :]
