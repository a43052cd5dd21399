"""Project-level jobs: regenerate and drift-check every spec, all in memory before anything is written."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from patchgen import __version__
from patchgen.config import ProjectConfig
from patchgen.errors import PatchgenError
from patchgen.files import package_inits, write_atomic
from patchgen.generate import Generated, engine_sha256, generate, templates_sha256, unified_diff
from patchgen.header import body_hash, parse_inputs, split
from patchgen.spec import Spec, load_spec
from patchgen.upstream import PinnedSource, UpstreamSource


def load_specs(config: ProjectConfig, models: list[str] | None) -> list[Spec]:
    available = config.models()
    if not models:
        return [load_spec(config.spec_path(m), config.templates_dir) for m in available]
    unknown = [m for m in models if m not in available]
    if unknown:
        raise PatchgenError(
            f"unknown model(s) {unknown}: no {config.specs_dir.name}/<model>.toml; "
            f"available: {', '.join(available) or 'none'}"
        )
    return [load_spec(config.spec_path(m), config.templates_dir) for m in models]


def outputs(config: ProjectConfig, gen: Generated) -> dict[Path, str]:
    return {
        config.root / gen.relpath: gen.text,
        config.root / gen.diff_relpath: gen.diff,
        **package_inits(config.root, gen.relpath),
    }


@dataclass(frozen=True)
class Change:
    path: Path
    status: str  # "new" | "changed" | "unchanged"


def regen(
    config: ProjectConfig, specs: list[Spec], dry_run: bool = False, source: UpstreamSource | None = None
) -> list[Change]:
    source = source or PinnedSource(config.pins)
    files: dict[Path, str] = {}
    for spec in specs:  # generate everything first: one bad spec leaves generated/ untouched
        files.update(outputs(config, generate(spec, source, config)))
    changes = []
    for path, text in sorted(files.items()):
        old = path.read_text(encoding="utf-8") if path.is_file() else None
        changes.append(Change(path, "new" if old is None else "unchanged" if old == text else "changed"))
    if not dry_run:
        write_atomic({c.path: files[c.path] for c in changes if c.status != "unchanged"})
    return changes


@dataclass(frozen=True)
class Drift:
    path: Path
    reason: str
    diff: str = ""


def check_spec(config: ProjectConfig, spec: Spec, source: UpstreamSource, full: bool = False) -> list[Drift]:
    """Prove a spec's outputs current from hashes alone; regenerate only when an input changed."""
    target = config.root / spec.output
    upstream = source.read(spec.module)
    if not target.is_file():
        return [Drift(target, f"missing; run `patchgen regen {spec.name}`")]
    text = target.read_text(encoding="utf-8")
    fields, body = split(text)
    expected_inputs = (
        upstream.pin,
        upstream.sha256,
        spec.sha256,
        templates_sha256(spec),
        __version__,
        engine_sha256(),
    )
    fresh = (
        not full
        and fields is not None
        and parse_inputs(fields) == expected_inputs
        and fields.get("body") == f"sha256={body_hash(body)}"
    )
    drifts = []
    if fresh:
        expected_text, expected_diff = text, unified_diff(upstream, text, spec.output)
    else:
        gen = generate(spec, source, config)
        expected_text, expected_diff = gen.text, gen.diff
        if text != expected_text:
            drifts.append(Drift(target, _reason(fields, body, expected_inputs), _show(text, expected_text, target)))
    diff_path = target.with_name(target.name + ".diff")
    if not diff_path.is_file() or diff_path.read_text(encoding="utf-8") != expected_diff:
        drifts.append(Drift(diff_path, f"review diff missing or stale; run `patchgen regen {spec.name}`"))
    for init in package_inits(config.root, spec.output):
        if not init.is_file():
            drifts.append(Drift(init, f"package file missing; run `patchgen regen {spec.name}`"))
    return drifts


def _reason(fields: dict[str, str] | None, body: str, expected_inputs: tuple[str, ...]) -> str:
    if fields is None:
        return "provenance header missing or damaged"
    if fields.get("body") != f"sha256={body_hash(body)}":
        return "edited by hand (body hash differs from its header); generated files are never edited"
    names = ("upstream version", "upstream source", "spec", "templates", "patchgen version", "patchgen engine")
    changed = [n for n, a, b in zip(names, parse_inputs(fields) or (), expected_inputs, strict=False) if a != b]
    return f"inputs changed ({', '.join(changed) or 'header'}); run `patchgen regen`"


def _show(old: str, new: str, path: Path, limit: int = 60) -> str:
    lines = list(
        difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            fromfile=f"{path.name} (checked in)",
            tofile=f"{path.name} (regenerated)",
        )
    )
    more = f"... {len(lines) - limit} more diff lines\n" if len(lines) > limit else ""
    return "".join(lines[:limit]) + more


def check(
    config: ProjectConfig, specs: list[Spec], full: bool = False, source: UpstreamSource | None = None
) -> list[Drift]:
    source = source or PinnedSource(config.pins)
    return [d for spec in specs for d in check_spec(config, spec, source, full)]
