"""Where upstream modeling sources come from, read as text without importing the upstream package.

Importing transformers would import torch; `patchgen check` must stay a seconds-long, torch-free gate.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from patchgen.errors import PatchgenError


@dataclass(frozen=True)
class UpstreamFile:
    package: str
    version: str
    module: str
    relpath: str  # path inside the package's distribution, e.g. transformers/models/qwen3/modeling_qwen3.py
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    @property
    def pin(self) -> str:
        return f"{self.package}=={self.version}"


class UpstreamSource(Protocol):
    def version(self, package: str) -> str: ...

    def read(self, module: str) -> UpstreamFile: ...


def module_relpath(module: str) -> str:
    return module.replace(".", "/") + ".py"


class InstalledSource:
    """Upstream files of the packages installed in this environment, located via import specs (no import)."""

    def version(self, package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError as exc:
            raise PatchgenError(f"upstream package {package!r} is not installed; install the pinned version") from exc

    def read(self, module: str) -> UpstreamFile:
        package = module.split(".")[0]
        found = importlib.util.find_spec(package)  # top-level find_spec does not execute the package
        if found is None or not found.submodule_search_locations:
            raise PatchgenError(f"upstream package {package!r} is not installed; install the pinned version")
        relpath = module_relpath(module)
        path = Path(list(found.submodule_search_locations)[0]).parent / relpath
        if not path.is_file():
            raise PatchgenError(f"upstream module {module!r} not found in {package}=={self.version(package)} "
                                f"(looked for {path}); check the spec's 'module' key")
        return UpstreamFile(package, self.version(package), module, relpath, path.read_text(encoding="utf-8"))


class PinnedSource:
    """The installed source, refusing any version other than the pin, so generated files stay reproducible."""

    def __init__(self, pins: dict[str, str], inner: UpstreamSource | None = None) -> None:
        self.pins = pins
        self.inner = inner or InstalledSource()

    def version(self, package: str) -> str:
        if package not in self.pins:
            raise PatchgenError(f"no pin for upstream package {package!r}; add it to [tool.patchgen] pins")
        installed = self.inner.version(package)
        if installed != self.pins[package]:
            raise PatchgenError(
                f"installed {package}=={installed} but the pin is {package}=={self.pins[package]}; generated files "
                f"derive from the pinned release. Install it (pip install {package}=={self.pins[package]}) or "
                f"review an upgrade with `patchgen upgrade --to {package}=={installed}`")
        return installed

    def read(self, module: str) -> UpstreamFile:
        self.version(module.split(".")[0])
        return self.inner.read(module)
