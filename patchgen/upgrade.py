"""`patchgen upgrade`: regenerate every spec against a release read from its wheel and say, per patch, what happens.

The pinned release (installed, or its wheel when a different version is installed) is the baseline; the new
release comes from a wheel. Each patch resolves on its own against both (`resolve_each`), so one moved anchor
does not hide the others; what that says of each patch is `patchgen.upgrade_status`. A model's new file is built
from the patches that apply; it is complete, and may replace the checked-in one, only when all of them do.
Everything is computed in memory: the review directory (`patchgen.upgrade_review`) is swapped in whole, and `apply`
writes generated/ and pyproject.toml in one atomic batch or not at all.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from pathlib import Path

from patchgen.config import ProjectConfig, with_pins
from patchgen.cst.plan import Plan, resolve_each
from patchgen.errors import PatchgenError
from patchgen.files import write_atomic
from patchgen.generate import Generated, build, read_unit, read_units, with_patches
from patchgen.header import split
from patchgen.ownership import confinement, outputs
from patchgen.spec import Patch, Spec
from patchgen.units import units as spec_units
from patchgen.upgrade_status import PatchStatus, Region, UpstreamLines, clean_message, patch_regions, patch_status
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
            spec, old, None, (), (), None, current, problem=f"module missing: {clean_message(config, str(exc))}"
        )
    try:
        news = with_patches(spec, read)
    except PatchgenError as exc:
        return ModelResult(
            spec,
            old,
            read[0].upstream,
            (),
            (),
            None,
            current,
            problem=f"generation error: {clean_message(config, str(exc))}",
        )
    statuses: dict[int, PatchStatus] = {}
    regions: list[Region] = []
    plans, failed = [], set()
    for new in news:
        before = olds.get(new.unit.name)
        old_plan = resolve_each(before.module, before.patches)[0] if before is not None else Plan()
        plan, errors = resolve_each(new.module, new.patches)
        old_lines, new_lines = (UpstreamLines(before.module) if before else None), UpstreamLines(new.module)
        prefix = f"{new.unit.name}:" if new.unit.companion else ""
        for patch in new.patches:
            status = patch_status(patch, plan, old_plan, errors, new_lines, old_lines, config)
            statuses[patch.index] = dataclasses.replace(status, scope=prefix + patch.scope) if prefix else status
        old_file, old_module = (before.upstream, before.module) if before else (None, None)
        regions += patch_regions(
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
            problem=f"generation error: {clean_message(config, str(exc))}",
        )
    return ModelResult(spec, old, news[0].upstream, ordered, tuple(regions), generated, current)


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
