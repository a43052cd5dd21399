"""Project-level jobs: regenerate and drift-check every spec, all in memory before anything is written.

Before any generation, the specs are checked as a set: each `output` (and each companion's) lies inside the
generated directory, no two share one, and every `module` belongs to a pinned upstream package. `owned_paths` is the
one definition of the files a spec owns under the generated directory; anything else there is an orphan.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import gc
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from patchgen import __version__
from patchgen.config import ProjectConfig
from patchgen.errors import PatchgenError
from patchgen.files import PACKAGE_INIT, package_inits, recover, write_atomic
from patchgen.header import body_hash, parse_inputs, split
from patchgen.journal import Confinement
from patchgen.model import module_of, sidecar_path
from patchgen.output_package import check_output_package
from patchgen.provenance import engine_sha256, templates_sha256, unified_diff
from patchgen.spec import MAX_EXTENDS_DEPTH, Spec, companion_output, load_spec, read_toml
from patchgen.upstream import PinnedSource, UpstreamSource, normalize_name

if TYPE_CHECKING:
    from patchgen.generate import Generated

# Limits that make hostile or runaway input fail fast and clearly instead of exhausting time or the stack (the
# limits of one spec file are in patchgen.spec).
MAX_WRAPS_PER_ANCHOR = 8
MAX_WRAPS_PER_SCOPE = 32  # wraps of nested expressions nest too (the real specs have at most 3 per scope)


def load_specs(config: ProjectConfig, models: list[str] | None) -> list[Spec]:
    """The named specs (all when `models` is empty), each checked against the project before anything runs."""
    available = config.models()
    if not available:
        raise PatchgenError(
            f"no specs: {config.specs_dir} has no *.toml file ([tool.patchgen] specs = "
            f"{_rel(config, config.specs_dir)!r} in {config.root / 'pyproject.toml'}); fix the path or add a spec"
        )
    unknown = [m for m in models or [] if m not in available]
    if unknown:
        raise PatchgenError(
            f"unknown model(s) {unknown}: no {config.specs_dir.name}/<model>.toml; available: {', '.join(available)}"
        )
    specs = [load_spec(config.spec_path(name), config.templates_dir) for name in models or available]
    for spec in specs:
        check_limits(spec)
        check_output(config, spec)
        check_module(config, spec)
        check_model_upstream(config, spec)
    check_unique_outputs(config, specs)
    return specs


def check_limits(spec: Spec) -> None:
    """Refuse, before any work, what would only exhaust the engine: each nested wrap re-parses the expression it
    wraps, so hundreds of them on one expression take minutes and end in a RecursionError (the patch count is
    limited when the spec loads)."""
    wraps: dict[tuple[str, str], list[int]] = {}
    for patch in spec.patches:
        if getattr(patch.template, "op", None) == "wrap" and patch.anchor_text:
            try:
                key = ast.unparse(ast.parse(patch.anchor_text.strip(), mode="eval"))
            except (SyntaxError, ValueError):
                continue  # not an expression: resolving the patch says so
            wraps.setdefault((patch.scope, key), []).append(patch.index)
    per_scope: dict[str, list[int]] = {}
    for (scope, _), indices in wraps.items():
        per_scope.setdefault(scope, []).extend(indices)
    for scope, indices in per_scope.items():
        if len(indices) > MAX_WRAPS_PER_SCOPE:
            raise PatchgenError(
                f"{spec.path}: {len(indices)} wrap patches in {scope!r}; at most {MAX_WRAPS_PER_SCOPE} per scope "
                f"(wraps of nested expressions nest; each re-parses what it wraps): merge them into fewer templates"
            )
    for (scope, anchor), indices in wraps.items():
        if len(indices) > MAX_WRAPS_PER_ANCHOR:
            raise PatchgenError(
                f"{spec.path}: patches {_ranges(indices)} wrap the same expression {anchor!r} in {scope!r} "
                f"{len(indices)} times; at most {MAX_WRAPS_PER_ANCHOR} nested wraps: merge them into one template"
            )


def _ranges(numbers: list[int]) -> str:
    """`[1, 2, 3, 7]` -> `1-3, 7`."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def with_dependents(config: ProjectConfig, specs: list[Spec]) -> list[Spec]:
    """`specs`, then every spec that `extends` one of them (directly or not)."""
    named = {spec.path.resolve() for spec in specs}
    extra = [
        spec
        for spec in load_specs(config, None)
        if spec.path.resolve() not in named and any(base.resolve() in named for base in spec.extends)
    ]
    return [*specs, *sorted(extra, key=lambda spec: spec.name)]


def _rel(config: ProjectConfig, path: Path) -> str:
    return path.relative_to(config.root).as_posix() if path.is_relative_to(config.root) else str(path)


def check_output(config: ProjectConfig, spec: Spec) -> None:
    """`output` (and every companion's) is a plain relative path that resolves, symlinks included, to a module
    inside the generated dir."""
    for output in spec.outputs:
        check_output_path(config, spec.path, output)
        resolved, inside = (config.root / output).resolve(), config.generated_dir.resolve()
        if not resolved.is_relative_to(inside):
            raise PatchgenError(
                f"{spec.path}: key 'output' = {output!r}: resolves to {resolved} (through a symlink), outside the "
                f"generated directory {inside}"
            )
    check_output_package(spec.path, spec.output)  # not a diffusers pipelines name (patchgen.output_package)


def check_output_path(config: ProjectConfig, path: Path, output: str) -> None:
    """The spec file at `path` names in `output` a module path inside the generated directory, as written (no
    file is looked at): plain, relative, every part a Python identifier (the output is imported as a module)."""
    generated, name = _rel(config, config.generated_dir), path.stem
    where = f"{path}: key 'output' = {output!r}"
    example = f"e.g. '{generated}/{name}/modeling_{name}.py'"
    plain = PurePosixPath(output)
    if "\\" in output or plain.as_posix() != output or any(part in (".", "..") for part in plain.parts):
        raise PatchgenError(
            f"{where}: write it as a plain relative path inside the generated directory, {example} "
            f"(no '..', './', '//' or backslashes)"
        )
    if plain.suffix != ".py" or not all(_OUTPUT_PART.fullmatch(p) for p in (*plain.parent.parts, plain.stem)):
        raise PatchgenError(
            f"{where}: every folder and the file name (before .py) must be a Python identifier of ASCII letters, "
            f"digits and _ (the output is imported as {generated}.<...>), {example}"
        )
    if not (config.root / output).is_relative_to(config.generated_dir):
        raise PatchgenError(
            f"{where}: outside the generated directory ([tool.patchgen] generated = {generated!r}); patchgen "
            f"writes only there, {example}"
        )
    if plain.name == "__init__.py":
        raise PatchgenError(
            f"{where}: __init__.py is the package file patchgen writes itself; name the module, e.g. "
            f"modeling_{name}.py"
        )


_OUTPUT_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_module(config: ProjectConfig, spec: Spec) -> None:
    """The upstream module must come from a pinned package (generated files derive from exact releases)."""
    package = spec.module.split(".")[0]
    pinned = sorted(config.pins)
    if normalize_name(package) in {normalize_name(p) for p in pinned}:
        return
    where = f"{spec.path}: key 'module' = {spec.module!r}"
    listed = ", ".join(pinned) or "none"
    if package in sys.stdlib_module_names:
        raise PatchgenError(
            f"{where}: {package!r} is a standard-library module, not an upstream package; name a module of a "
            f"pinned upstream package ({listed}), e.g. transformers.models.<model>.modeling_<model>"
        )
    raise PatchgenError(
        f"{where}: package {package!r} is not pinned ([tool.patchgen] pins: {listed}); name a module of a pinned "
        f"package, or, if {package} is an upstream package to generate from, add it to [tool.patchgen] pins "
        f'with its exact version ({package} = "<version>")'
    )


def check_model_upstream(config: ProjectConfig, spec: Spec) -> None:
    """`[model] upstream` is a public class of a pinned upstream package: the runtime imports it to build the
    reference model, so nothing else (`os.system`) may be named there."""
    if spec.model is None:
        return
    parts = spec.model.upstream.split(".")
    pinned = {normalize_name(name) for name in config.pins}
    if normalize_name(parts[0]) in pinned and not any(p.startswith("_") for p in parts) and parts[-1][:1].isupper():
        return
    raise PatchgenError(
        f"{spec.path}: [model] key 'upstream' = {spec.model.upstream!r}: must be a public class of a pinned upstream "
        f"package ({', '.join(sorted(config.pins)) or 'none pinned'}), e.g. transformers.AutoModelForCausalLM or "
        f"diffusers.WanTransformer3DModel"
    )


def check_unique_outputs(config: ProjectConfig, specs: list[Spec]) -> None:
    """No two specs may write the same file; specs not loaded are compared by their raw `output` values."""
    claimed: dict[Path, Path] = {}
    loaded = {spec.name for spec in specs}
    others = _declared_outputs(config, [name for name in config.models() if name not in loaded])
    for path, output, _ in [*((s.path, o, False) for s in specs for o in s.outputs), *others]:
        key = (config.root / output).resolve()
        if key in claimed and claimed[key] != path:
            first, second = sorted([claimed[key], path])
            raise PatchgenError(
                f"{second}: key 'output' = {output!r} is also the output of {first}; give each spec its own output"
            )
        claimed.setdefault(key, path)


def _declared_outputs(config: ProjectConfig, names: list[str]) -> list[tuple[Path, str, bool]]:
    """(path, output, is a companion's) of each output the named specs' TOML declares: `output`, and one per
    `[[companion]]` module (its own, or the nearest inherited table's); values that are not strings fail when the
    spec loads."""
    found = []
    for name in names:
        path = config.spec_path(name)
        try:
            data = read_toml(path)[0]
        except PatchgenError:
            continue
        output = data.get("output")
        if isinstance(output, str):
            found.append((path, output, False))
            found += [(path, companion_output(output, m), True) for m in _raw_companion_modules(config, data)]
    return found


def _raw_companion_modules(config: ProjectConfig, data: dict) -> list[str]:
    """The `[[companion]]` modules a spec's TOML declares or inherits through `extends`, as written."""
    for _ in range(MAX_EXTENDS_DEPTH + 1):
        tables = data.get("companion")
        if tables is not None or not isinstance(data.get("extends"), str):
            break
        try:
            data = read_toml(config.spec_path(data["extends"]))[0]
        except PatchgenError:
            return []
    tables = data.get("companion")
    if not isinstance(tables, list):
        return []
    return [t["module"] for t in tables if isinstance(t, dict) and isinstance(t.get("module"), str) and t["module"]]


def confinement(config: ProjectConfig) -> Confinement:
    """What a journaled write may touch: every file the current specs own (what `regen --all` writes), found from
    each spec's raw `output` as written (no spec is loaded, no file resolved), and pyproject.toml (its pins)."""
    owned: set[Path] = set()
    for path, output, companion in _declared_outputs(config, config.models()):
        try:
            check_output_path(config, path, output)
        except PatchgenError:
            continue  # not a valid output: loading that spec says why
        owned |= owned_paths(config, output, record=not companion)
    return Confinement(config.root, config.generated_dir, frozenset(owned), config.root / "pyproject.toml")


def finish_interrupted_write(config: ProjectConfig) -> str | None:
    """`files.recover` confined to what this project's specs may write."""
    return recover(config.root, lambda: confinement(config))


def owned_paths(config: ProjectConfig, output: str, record: bool = True) -> set[Path]:
    """Every file under the generated directory that a spec owns for one of its outputs: the module, its review
    diff, its package files, and (`record`: the spec's main output) the `.model.json` record."""
    target = config.root / output
    return {
        target,
        target.with_name(target.name + ".diff"),
        *([config.root / sidecar_path(output)] if record else []),
        *package_inits(config.generated_dir, target),
    }


def orphans(config: ProjectConfig, specs: list[Spec]) -> list[Path]:
    """Files under the generated directory that no spec owns (bytecode caches aside)."""
    owned = set().union(
        *(owned_paths(config, output, record=output == spec.output) for spec in specs for output in spec.outputs)
    )
    found = []
    for folder, dirs, files in os.walk(config.generated_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found += [Path(folder) / name for name in files if Path(folder) / name not in owned]
    return sorted(found)


def is_whole_project(config: ProjectConfig, specs: list[Spec]) -> bool:
    return {spec.name for spec in specs} == set(config.models())


def outputs(config: ProjectConfig, gen: Generated) -> dict[Path, str]:
    """What regen writes for one generated model, its companions included (a subset of `owned_paths`)."""
    files: dict[Path, str] = {}
    for one in gen.files:
        target = config.root / one.relpath
        files.update({target: one.text, config.root / one.diff_relpath: one.diff})
        files.update(package_inits(config.generated_dir, target))
    if gen.spec.model is not None:
        files[config.root / sidecar_path(gen.relpath)] = model_record(gen.spec)
    return files


def model_record(spec: Spec) -> str:
    """The `.model.json` text of a spec with a `[model]` table, naming its companion modules too."""
    return spec.model.to_json(spec.name, spec.output, [module_of(c.output) for c in spec.companions])


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


ORPHAN = "no spec owns it (a removed or renamed spec's output?); delete it or restore its spec"


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
