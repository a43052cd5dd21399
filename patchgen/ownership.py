"""Which files under the generated directory each spec owns, and what regen writes there.

`owned_paths` is the one definition of the files a spec owns; anything else under the generated directory is an
orphan (drift, never deleted). A journaled write is confined to what the current specs own (`confinement`), found
from their raw tables so that recovery needs no spec to load. Apart from the orchestration (`patchgen.project`)
because recovery, `patchgen upgrade --apply` and `--verify` need the same answers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from patchgen.config import ProjectConfig
from patchgen.errors import PatchgenError
from patchgen.files import package_inits, recover
from patchgen.journal import Confinement
from patchgen.model import derive_supports, module_of, sidecar_path
from patchgen.spec import Patch, Spec
from patchgen.spec_set import check_output_path, declared_outputs

if TYPE_CHECKING:
    from patchgen.generate import Generated

ORPHAN = "no spec owns it (a removed or renamed spec's output?); delete it or restore its spec"


def confinement(config: ProjectConfig) -> Confinement:
    """What a journaled write may touch: every file the current specs own (what `regen --all` writes), found from
    each spec's raw `output` as written (no spec is loaded, no file resolved), and pyproject.toml (its pins)."""
    owned: set[Path] = set()
    for path, output, companion in declared_outputs(config, config.models()):
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
    """The `.model.json` text of a spec with a `[model]` table, naming its companion modules too, and what its
    patches support (derived from them, with each template variable's default where the spec gives no value)."""
    applied = [(p.template.name, p.scope, _values(p)) for p in spec.patches]
    supports = derive_supports(applied, spec.model.handles, spec.model.unsupported)
    return spec.model.to_json(spec.name, spec.output, [module_of(c.output) for c in spec.companions], supports)


def _values(patch: Patch) -> dict[str, Any]:
    """A patch's variables: the spec's values over the template's defaults."""
    defaults = {v.name: v.default for v in patch.template.vars if not v.required}
    return {**defaults, **patch.vars}
