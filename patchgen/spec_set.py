"""The specs a command runs on, checked as a set against the project before anything is generated.

Each `output` (and each companion's) lies inside the generated directory, no two specs share one, every `module`
belongs to a pinned upstream package, and no spec holds more wraps than the engine can nest. Apart from the
orchestration (`patchgen.project`) because these checks read only the specs and the project config, and
`patchgen.ownership` reuses them on raw spec tables to confine a journaled write.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path, PurePosixPath

from patchgen.config import ProjectConfig
from patchgen.errors import PatchgenError
from patchgen.output_package import check_output_package
from patchgen.spec import Spec, load_spec
from patchgen.spec_companions import companion_output
from patchgen.spec_extends import MAX_EXTENDS_DEPTH
from patchgen.spec_schema import read_toml
from patchgen.upstream import normalize_name

# Limits that make hostile or runaway input fail fast and clearly instead of exhausting time or the stack (the
# limits of one spec file are in patchgen.spec_schema).
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
    others = declared_outputs(config, [name for name in config.models() if name not in loaded])
    for path, output, _ in [*((s.path, o, False) for s in specs for o in s.outputs), *others]:
        key = (config.root / output).resolve()
        if key in claimed and claimed[key] != path:
            first, second = sorted([claimed[key], path])
            raise PatchgenError(
                f"{second}: key 'output' = {output!r} is also the output of {first}; give each spec its own output"
            )
        claimed.setdefault(key, path)


def declared_outputs(config: ProjectConfig, names: list[str]) -> list[tuple[Path, str, bool]]:
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
