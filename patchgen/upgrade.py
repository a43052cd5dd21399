"""`patchgen upgrade`: regenerate every spec against a release read from its wheel and say, per patch, what happens.

The pinned release (installed, or its wheel when a different version is installed) is the baseline; the new
release comes from a wheel. Each patch resolves on its own against both (`resolve_each`), so one moved anchor
does not hide the others. A model's new file is built from the patches that apply; it is complete, and may
replace the checked-in one, only when all of them do. Everything is computed in memory: the review directory
is swapped in whole, and `apply` writes generated/ and pyproject.toml in one atomic batch or not at all.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from patchgen.config import ProjectConfig, with_pins
from patchgen.cst.locate import LocateError, code_of, normalize, scope_chain
from patchgen.cst.plan import Edit, Plan, PlanError, resolve_each
from patchgen.errors import PatchgenError
from patchgen.files import write_atomic
from patchgen.generate import Generated, build, candidate_lines, read_unit, read_units, with_patches
from patchgen.header import split
from patchgen.project import confinement, outputs
from patchgen.spec import Patch, Spec
from patchgen.units import units as spec_units
from patchgen.upstream import (
    InstalledSource,
    PinnedSource,
    UpstreamFile,
    UpstreamSource,
    Wheel,
    WheelSource,
    normalize_name,
)
from patchgen.wheels import Target, obtain

APPLIED = "applied"
REPLACED_CHANGED = "replaced code changed"  # applies, but the upstream code it replaces is not what it was
APPLIES = (APPLIED, REPLACED_CHANGED)
REVIEW_DIR = "upgrade-review"


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


@dataclass(frozen=True)
class ModelResult:
    spec: Spec
    old: UpstreamFile | None
    new: UpstreamFile | None
    patches: tuple[PatchStatus, ...]
    regions: tuple[Region, ...]
    generated: Generated | None  # the new file (with its companions'), built from the patches that apply
    current: dict[str, str | None]  # each checked-in generated file (None: absent), by output path
    problem: str = ""  # a failure of the model as a whole, e.g. "generation error: <message>"

    @property
    def ok(self) -> bool:
        return not self.problem and all(p.applies for p in self.patches)

    @property
    def skipped(self) -> list[Patch]:
        return [p.patch for p in self.patches if not p.applies]

    @property
    def unchanged(self) -> bool:
        """Whether every new file is byte-identical to the checked-in one."""
        return self.generated is not None and all(self.current.get(f.relpath) == f.text for f in self.generated.files)

    def output_diff(self) -> str:
        """Checked-in bodies -> new bodies, file after file (headers left out: they change with every input hash)."""
        if self.generated is None:
            return ""
        out = []
        for one in self.generated.files:
            current = self.current.get(one.relpath)
            old = split(current)[1] if current is not None else ""
            new = split(one.text)[1]
            what = "checked in" if current is not None else "absent"
            lines = difflib.unified_diff(
                old.splitlines(keepends=True),
                new.splitlines(keepends=True),
                fromfile=f"a/{one.relpath} ({what})",
                tofile=f"b/{one.relpath} ({one.upstream.pin})",
            )
            out += [line if line.endswith("\n") else line + "\n" for line in lines]
        return "".join(out)


@dataclass(frozen=True)
class Upgrade:
    wheels: tuple[Wheel, ...]
    pins: dict[str, str]  # the pins before the upgrade
    models: tuple[ModelResult, ...]
    others: tuple[str, ...]  # specs of packages this upgrade does not touch

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.models)

    @property
    def name(self) -> str:
        return "_".join(f"{w.package}-{w.version}" for w in self.wheels)

    @property
    def command(self) -> str:
        return "patchgen upgrade " + " ".join(f"--to {w.pin}" for w in self.wheels)

    def moves(self) -> list[str]:
        return [f"{w.package} {self.pins.get(w.package, '?')} -> {w.version}" for w in self.wheels]


class _Lines:
    """Upstream line numbers of one parsed module (positions resolved once, on first use)."""

    def __init__(self, module: cst.Module) -> None:
        self.module = module
        self._positions = None

    def span(self, node: cst.CSTNode) -> tuple[int, int]:
        if self._positions is None:
            self._positions = MetadataWrapper(self.module, unsafe_skip_copy=True).resolve(PositionProvider)
        if isinstance(node, cst.Module):
            return 1, max(1, len(self.module.code.splitlines()))
        first = [self._positions[d].start.line for d in getattr(node, "decorators", ())]
        return min([*first, self._positions[node].start.line]), self._positions[node].end.line


def baseline_source(config: ProjectConfig, packages: set[str], cache: Path) -> tuple[UpstreamSource, list[str]]:
    """The pinned releases: installed where the installed version is the pin, else their wheels (cache or pip).
    Also says which wheels it had to download."""
    wheels, downloaded = [], []
    for name, version in sorted(config.pins.items()):
        if normalize_name(name) not in packages:
            continue
        try:
            installed = InstalledSource().version(name)
        except PatchgenError:
            installed = None
        if installed != version:
            wheel, fetched = obtain(
                Target(f"{name}=={version}", normalize_name(name), version), cache, config.wheel_sha256
            )
            wheels.append(wheel)
            downloaded += [wheel.path.name] if fetched else []
    return PinnedSource(config.pins, WheelSource(wheels, fallback=InstalledSource())), downloaded


def analyze(
    config: ProjectConfig,
    specs: list[Spec],
    wheels: list[Wheel],
    old_source: UpstreamSource,
    new_source: UpstreamSource | None = None,
) -> Upgrade:
    """Every spec of an upgraded package, against the pinned release (`old_source`) and the wheels."""
    packages = {w.package for w in wheels}
    new_source = new_source or WheelSource(wheels)
    mine = [s for s in specs if normalize_name(s.package) in packages]
    models = tuple(analyze_spec(config, spec, old_source, new_source) for spec in mine)
    others = tuple(s.name for s in specs if normalize_name(s.package) not in packages)
    pins = {normalize_name(k): v for k, v in config.pins.items()}
    return Upgrade(tuple(sorted(wheels, key=lambda w: w.package)), pins, models, others)


def analyze_spec(
    config: ProjectConfig, spec: Spec, old_source: UpstreamSource, new_source: UpstreamSource
) -> ModelResult:
    current = {}
    for output in spec.outputs:
        target = config.root / output
        current[output] = target.read_text(encoding="utf-8") if target.is_file() else None
    try:
        olds = {s.unit.name: s for s in read_units(spec, old_source)}
    except PatchgenError:
        olds = {}  # a spec broken against its own pin: report the new side only
    old = olds[spec_units(spec)[0].name].upstream if olds else None
    try:
        read = [read_unit(unit, new_source) for unit in spec_units(spec)]
    except PatchgenError as exc:
        return ModelResult(
            spec, old, None, (), (), None, current, problem=f"module missing: {_clean(config, str(exc))}"
        )
    try:
        news = with_patches(spec, read)
    except PatchgenError as exc:
        return ModelResult(
            spec, old, read[0].upstream, (), (), None, current, problem=f"generation error: {_clean(config, str(exc))}"
        )
    statuses: dict[int, PatchStatus] = {}
    regions: list[Region] = []
    plans, failed = [], set()
    for new in news:
        before = olds.get(new.unit.name)
        old_plan = resolve_each(before.module, before.patches)[0] if before is not None else Plan()
        plan, errors = resolve_each(new.module, new.patches)
        old_lines, new_lines = (_Lines(before.module) if before else None), _Lines(new.module)
        prefix = f"{new.unit.name}:" if new.unit.companion else ""
        for patch in new.patches:
            status = _status(patch, plan, old_plan, errors, new_lines, old_lines, config)
            statuses[patch.index] = dataclasses.replace(status, scope=prefix + patch.scope) if prefix else status
        old_file, old_module = (before.upstream, before.module) if before else (None, None)
        regions += _regions(
            new.patches, prefix, old_file, old_module, old_lines, old_plan, new.upstream, new.module, new_lines, plan
        )
        plans.append(plan)
        failed |= {e.patch.index for e in errors}
    ordered = tuple(statuses[p.index] for p in spec.patches)
    applied = dataclasses.replace(spec, patches=tuple(p for p in spec.patches if p.index not in failed))
    sources = tuple(dataclasses.replace(s, patches=tuple(p for p in s.patches if p.index not in failed)) for s in news)
    try:
        generated = build(applied, sources, plans, config, new_source)
    except PatchgenError as exc:
        return ModelResult(
            spec,
            old,
            news[0].upstream,
            ordered,
            tuple(regions),
            None,
            current,
            problem=f"generation error: {_clean(config, str(exc))}",
        )
    return ModelResult(spec, old, news[0].upstream, ordered, tuple(regions), generated, current)


def _clean(config: ProjectConfig, message: str) -> str:
    """Messages name files by absolute path; the report is the same on every machine."""
    return message.replace(str(config.root) + os.sep, "")


def _edits_of(plan: Plan, patch: Patch) -> list[Edit]:
    return [e for e in plan.edits if e.patch.index == patch.index]


def _where(edit: Edit, lines: _Lines) -> str:
    return "end of module" if edit.where == "end" else f"line {lines.span(edit.target)[0]}"


def _replaced_text(edit: Edit) -> str:
    return "\n".join(normalize(code_of(n).strip()) or code_of(n) for n in (edit.target, *edit.span))


def _status(
    patch: Patch,
    plan: Plan,
    old_plan: Plan,
    errors: list[PlanError],
    new_lines: _Lines,
    old_lines: _Lines | None,
    config: ProjectConfig,
) -> PatchStatus:
    error = next((e for e in errors if e.patch.index == patch.index), None)
    if error is not None:
        candidates = tuple(candidate_lines(new_lines.module, error))
        detail = _clean(config, error.message.splitlines()[0])
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


def _regions(
    patches: tuple[Patch, ...],
    prefix: str,
    old: UpstreamFile | None,
    old_module: cst.Module | None,
    old_lines: _Lines | None,
    old_plan: Plan,
    new: UpstreamFile,
    new_module: cst.Module,
    new_lines: _Lines,
    plan: Plan,
):
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
    old_lines: _Lines | None,
    new: UpstreamFile,
    new_node,
    new_lines: _Lines,
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


# ---- writing ------------------------------------------------------------------------------------------------


def review_files(upgrade: Upgrade, report: str) -> dict[str, str]:
    """What the review directory holds: REPORT.md and each new generated file with its upstream diff."""
    files = {"REPORT.md": report}
    for model in upgrade.models:
        for one in model.generated.files if model.generated is not None else ():
            files[one.relpath] = one.text
            files[one.diff_relpath] = one.diff
    return files


def write_review(config: ProjectConfig, upgrade: Upgrade, report: str, extra: dict[str, str] | None = None) -> Path:
    """Replace `upgrade-review/<name>/` as a whole: a temp dir beside it is filled, then renamed into place.
    `extra`: more files by relative path (`specs.diff` of `--migrate`)."""
    final = config.root / REVIEW_DIR / upgrade.name
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{upgrade.name}."))
    try:
        for relpath, text in sorted({**review_files(upgrade, report), **(extra or {})}.items()):
            path = staging / relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8", newline="")
        if final.exists():
            old = final.with_name(f".{upgrade.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def apply(config: ProjectConfig, upgrade: Upgrade) -> list[Path]:
    """Write the new generated files and the new pins, all in one atomic batch; refuses unless every patch
    of every model applies. Returns the paths that changed."""
    if not upgrade.ok:
        raise PatchgenError("refusing to apply: not every patch applies (see the report)")
    files: dict[Path, str] = {}
    for model in upgrade.models:
        files.update(outputs(config, model.generated))
    pyproject = config.root / "pyproject.toml"
    keys = {normalize_name(name): name for name in config.pins}
    files[pyproject] = with_pins(
        pyproject.read_text(encoding="utf-8"), {keys[w.package]: w.version for w in upgrade.wheels}
    )
    changed = {p: t for p, t in files.items() if not p.is_file() or p.read_text(encoding="utf-8") != t}
    write_atomic(changed, confinement(config))
    return sorted(changed)
