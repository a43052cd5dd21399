"""Project-level jobs: regenerate and drift-check every spec, all in memory before anything is written.

The specs arrive checked as a set (`patchgen.spec_set`); what each one owns under the generated directory, and what
regen writes there, is `patchgen.ownership`. `check` proves an output current from its header's hashes alone and
regenerates only when an input changed (`--full`: always).
"""

from __future__ import annotations

import contextlib
import difflib
import gc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from patchgen import __version__
from patchgen.config import ProjectConfig
from patchgen.files import PACKAGE_INIT, package_inits, write_atomic
from patchgen.header import body_hash, parse_inputs, split
from patchgen.model import sidecar_path
from patchgen.ownership import ORPHAN, confinement, finish_interrupted_write, model_record, orphans, outputs
from patchgen.provenance import engine_sha256, templates_sha256, unified_diff
from patchgen.spec import Spec
from patchgen.upstream import PinnedSource, UpstreamSource


def is_whole_project(config: ProjectConfig, specs: list[Spec]) -> bool:
    return {spec.name for spec in specs} == set(config.models())


@contextlib.contextmanager
def without_cyclic_gc() -> Iterator[None]:
    """Generation allocates millions of short-lived, acyclic libcst nodes, and every full cyclic collection re-scans
    all the trees still alive: pausing the collector makes generation about 13% faster (reference counting still
    frees everything; whatever cycles arise are collected when it resumes)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class Change:
    path: Path
    status: str  # "new" | "changed" | "unchanged" | "orphan" (a file no spec owns; never deleted)


def regen(
    config: ProjectConfig, specs: list[Spec], dry_run: bool = False, source: UpstreamSource | None = None
) -> list[Change]:
    from patchgen.generate import generate  # libcst and the rewriter: only when something is generated

    finish_interrupted_write(config)
    source = source or PinnedSource(config.pins)
    files: dict[Path, str] = {}
    with without_cyclic_gc():
        for spec in specs:  # generate everything first: one bad spec leaves generated/ untouched
            files.update(outputs(config, generate(spec, source, config)))
    changes = []
    for path, text in sorted(files.items()):
        old = path.read_bytes() if path.is_file() else None
        changes.append(Change(path, "new" if old is None else "unchanged" if old == text.encode() else "changed"))
    if not dry_run:
        write_atomic({c.path: files[c.path] for c in changes if c.status != "unchanged"}, confinement(config))
    if is_whole_project(config, specs):
        changes += [Change(path, "orphan") for path in orphans(config, specs)]
    return changes


@dataclass(frozen=True)
class Drift:
    path: Path
    reason: str
    diff: str = ""


def check_spec(config: ProjectConfig, spec: Spec, source: UpstreamSource, full: bool = False) -> list[Drift]:
    """Prove a spec's outputs (its companions' included) current from hashes alone; regenerate only when an input
    changed."""
    files = [(spec.output, spec.module), *((c.output, c.module) for c in spec.companions)]
    found = []
    for output, module in files:
        target = config.root / output
        upstream = source.read(module)
        if not target.is_file():
            return [Drift(target, f"missing; run `patchgen regen {spec.name}`")]
        found.append((output, upstream, *_read_generated(target, spec)))
    drifts = []
    expected_inputs = [
        (u.pin, u.sha256, spec.sha256, templates_sha256(spec), __version__, engine_sha256()) for _, u, *_ in found
    ]
    fresh = not full and all(
        undecodable is None
        and fields is not None
        and parse_inputs(fields) == inputs
        and fields.get("body") == f"sha256={body_hash(body)}"
        for (_, _, _, text, undecodable, fields, body), inputs in zip(found, expected_inputs, strict=True)
    )
    if fresh:
        expected = {output: (text, unified_diff(upstream, text, output)) for output, upstream, _, text, *_ in found}
    else:
        from patchgen.generate import generate  # libcst and the rewriter: only when hashes cannot prove freshness

        gen = generate(spec, source, config)
        expected = {one.relpath: (one.text, one.diff) for one in gen.files}
        for (output, _, raw, text, undecodable, fields, body), inputs in zip(found, expected_inputs, strict=True):
            if raw != expected[output][0].encode():
                reason = undecodable or _reason(spec, fields, body, inputs)
                target = config.root / output
                drifts.append(Drift(target, reason, _show(text, expected[output][0], target)))
    for output, _, *_ in found:
        target = config.root / output
        diff_path = target.with_name(target.name + ".diff")
        if not diff_path.is_file() or diff_path.read_bytes() != expected[output][1].encode():
            drifts.append(Drift(diff_path, f"review diff missing or stale; run `patchgen regen {spec.name}`"))
        for init in package_inits(config.generated_dir, target):
            if not init.is_file() or init.read_bytes() != PACKAGE_INIT.encode():
                drifts.append(Drift(init, f"package file missing or changed; run `patchgen regen {spec.name}`"))
    sidecar = config.root / sidecar_path(spec.output)
    if spec.model is not None:
        if not sidecar.is_file() or sidecar.read_bytes() != model_record(spec).encode():
            drifts.append(Drift(sidecar, f"model record missing or stale; run `patchgen regen {spec.name}`"))
    elif sidecar.is_file():
        drifts.append(Drift(sidecar, f"{spec.path.name} has no [model] table any more; delete this stale record"))
    return list(dict.fromkeys(drifts))


def _read_generated(target: Path, spec: Spec) -> tuple[bytes, str, str | None, dict[str, str] | None, str]:
    """(bytes, text, why the bytes are not text or None, header fields, body) of a generated file."""
    raw = target.read_bytes()  # bytes, not read_text: a changed line ending is drift too
    try:
        text, undecodable = raw.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        text = raw.decode("utf-8", "replace")
        undecodable = (
            f"not UTF-8 text ({exc.reason} at byte {exc.start}); generated files are never edited: "
            f"run `patchgen regen {spec.name}`"
        )
    fields, body = split(text)
    return raw, text, undecodable, fields, body


def _reason(spec: Spec, fields: dict[str, str] | None, body: str, expected_inputs: tuple[str, ...]) -> str:
    if fields is None:
        return "provenance header missing or damaged"
    if fields.get("body") != f"sha256={body_hash(body)}":
        return "edited by hand (body hash differs from its header); generated files are never edited"
    names = ("upstream version", "upstream source", "spec", "templates", "patchgen version", "patchgen engine")
    recorded = parse_inputs(fields)
    if recorded is None:
        return f"provenance header damaged; run `patchgen regen {spec.name}`"
    changed = [n for n, a, b in zip(names, recorded, expected_inputs, strict=True) if a != b]
    if not changed:
        return (
            "the body is not what the spec, templates and upstream produce, although its header's hashes say it "
            f"is (edited and re-hashed by hand?); run `patchgen regen {spec.name}`"
        )
    return f"inputs changed ({', '.join(changed)}); run `patchgen regen`"


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
    finish_interrupted_write(config)
    source = source or PinnedSource(config.pins)
    with without_cyclic_gc():
        drifts = [d for spec in specs for d in check_spec(config, spec, source, full)]
    if is_whole_project(config, specs):
        drifts += [Drift(path, ORPHAN) for path in orphans(config, specs)]
    return drifts
