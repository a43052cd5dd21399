"""The folder a spec's output lands in must not be named like a member of diffusers' `pipelines` package.

diffusers records each pipeline component as `(library, class)` (`_fetch_class_library_tuple`): when the second-to-last
part of the class's module path is an attribute of `diffusers.pipelines`, the library is that pipeline package. So a
class generated into `generated/wan/transformer_wan.py` is saved as library `wan`, `from_pretrained` looks for it in
`diffusers.pipelines.wan`, and the saved pipeline cannot be loaded. That holds for any generated class a pipeline can
hold (a DiT, a text encoder), hence `generated/<name>_dit/`. Nothing else about a folder's name matters: transformers
never reads a class's module path (a generated `generated/qwen3/` beside `transformers.models.qwen3` is harmless, as
transformers' own model tests with the generated classes swapped in show), and diffusers reads only `pipelines`.

The names are read from the installed diffusers' `pipelines/` directory (its subpackages and modules: a superset of
the attributes, without importing diffusers, so `patchgen check` stays torch-free); without diffusers installed no
pipeline can record the class, and nothing is refused.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
from pathlib import Path, PurePosixPath

from patchgen.errors import PatchgenError


@functools.cache
def diffusers_pipeline_names() -> frozenset[str]:
    """The subpackages and modules of the installed `diffusers.pipelines` (found on disk, nothing imported)."""
    try:
        found = importlib.util.find_spec("diffusers")
    except (ImportError, ValueError):
        return frozenset()
    names = set()
    for location in found.submodule_search_locations or [] if found is not None else []:
        try:
            entries = os.listdir(Path(location) / "pipelines")
        except OSError:
            continue
        for entry in entries:
            stem = entry[: -len(".py")] if entry.endswith(".py") else entry
            if stem.isidentifier() and not stem.startswith("_") and ("." not in entry or entry.endswith(".py")):
                names.add(stem)
    return frozenset(names)


def check_output_package(spec_path: Path, output: str) -> None:
    """Refuse an `output` whose folder (the second-to-last part of the generated module's path) names a member of
    diffusers.pipelines; the companions share that folder."""
    folder = PurePosixPath(output).parent
    if folder.name not in diffusers_pipeline_names():
        return
    try:
        version = f" {importlib.metadata.version('diffusers')}"
    except importlib.metadata.PackageNotFoundError:
        version = ""
    instead = (folder.parent / f"{folder.name}_dit" / PurePosixPath(output).name).as_posix()
    raise PatchgenError(
        f"{spec_path}: key 'output' = {output!r}: its folder {folder.name!r} is also diffusers.pipelines."
        f"{folder.name} (diffusers{version}), so a diffusers pipeline holding a class generated there saves it as "
        f"that pipeline package's and cannot load it again; name the folder apart, e.g. output = {instead!r}"
    )
