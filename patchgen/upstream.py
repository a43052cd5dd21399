"""Where upstream modeling sources come from, read as text without importing the upstream package.

Importing transformers would import torch; `patchgen check` must stay a seconds-long, torch-free gate.
"""

from __future__ import annotations

import email.parser
import functools
import hashlib
import importlib.metadata
import importlib.util
import re
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from patchgen.errors import PatchgenError

# The largest upstream file read (the largest modeling file, qwen3_omni_moe, is about 200 KB): a bigger one is
# not a modeling file, and parsing it would only exhaust memory and time.
MAX_UPSTREAM_BYTES = 16 << 20


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


@functools.lru_cache(maxsize=32)
def _installed_version(package: str) -> str:
    """Metadata lookups scan sys.path; the installed version cannot change while patchgen runs."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError as exc:
        raise PatchgenError(f"upstream package {package!r} is not installed; install the pinned version") from exc


def module_relpath(module: str) -> str:
    return module.replace(".", "/") + ".py"


def normalize_name(name: str) -> str:
    """A distribution name as wheel file names and pins compare it (PEP 503, with `_`): `Foo.Bar-x` -> `foo_bar_x`."""
    return re.sub(r"[-_.]+", "_", name).lower()


class InstalledSource:
    """Upstream files of the packages installed in this environment, located via import specs (no import)."""

    def version(self, package: str) -> str:
        return _installed_version(package)

    def read(self, module: str) -> UpstreamFile:
        package = module.split(".")[0]
        found = importlib.util.find_spec(package)  # top-level find_spec does not execute the package
        if found is None or not found.submodule_search_locations:
            raise PatchgenError(f"upstream package {package!r} is not installed; install the pinned version")
        relpath = module_relpath(module)
        path = Path(list(found.submodule_search_locations)[0]).parent / relpath
        if not path.is_file():
            raise PatchgenError(
                f"upstream module {module!r} not found in {package}=={self.version(package)} "
                f"(looked for {path}); check the spec's 'module' key"
            )
        if path.stat().st_size > MAX_UPSTREAM_BYTES:
            raise PatchgenError(f"{path}: larger than {MAX_UPSTREAM_BYTES} bytes; not a modeling file patchgen reads")
        text = decode_source(path.read_bytes(), str(path))
        return UpstreamFile(package, self.version(package), module, relpath, text)


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
                f"derive from the pinned release. Install it (pip install {package}=={self.pins[package]}), read it "
                f"from its wheel (`--from {package}=={self.pins[package]}`), or review an upgrade with "
                f"`patchgen upgrade --to {package}=={installed}`"
            )
        return installed

    def read(self, module: str) -> UpstreamFile:
        self.version(module.split(".")[0])
        return self.inner.read(module)


@dataclass(frozen=True)
class Wheel:
    """A release wheel on disk, identified by its own metadata (not by its file name)."""

    path: Path
    package: str  # normalized distribution name; for transformers and diffusers also the top-level package
    version: str

    @property
    def pin(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


def read_wheel(path: Path) -> Wheel:
    """Name and version from the wheel's `*.dist-info/METADATA`; a file that is no wheel is a user error."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(names) != 1:
                raise PatchgenError(f"{path}: not a wheel: expected one *.dist-info/METADATA, found {names or 'none'}")
            metadata = email.parser.HeaderParser().parsestr(archive.read(names[0]).decode("utf-8"))
    except (OSError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        raise PatchgenError(f"{path}: cannot read it as a wheel: {exc}") from exc
    if not metadata["Name"] or not metadata["Version"]:
        raise PatchgenError(f"{path}: wheel METADATA lacks Name or Version")
    return Wheel(path, normalize_name(metadata["Name"]), metadata["Version"].strip())


class WheelSource:
    """Upstream files read from release wheels (zip archives): nothing is installed, nothing imported.

    Packages without a wheel here are read from `fallback` (e.g. the pinned installed packages), if given.
    Text is decoded as `Path.read_text` decodes an installed file (UTF-8, universal newlines), so the same
    release read either way gives the same bytes, hashes and headers.
    """

    def __init__(self, wheels: Iterable[Wheel], fallback: UpstreamSource | None = None) -> None:
        self.wheels = {wheel.package: wheel for wheel in wheels}
        self.fallback = fallback

    def _wheel(self, package: str) -> Wheel | None:
        wheel = self.wheels.get(normalize_name(package))
        if wheel is None and self.fallback is None:
            given = ", ".join(sorted(self.wheels)) or "none"
            raise PatchgenError(f"no wheel given for upstream package {package!r} (wheels for: {given})")
        return wheel

    def version(self, package: str) -> str:
        wheel = self._wheel(package)
        return wheel.version if wheel is not None else self.fallback.version(package)

    def read(self, module: str) -> UpstreamFile:
        package = module.split(".")[0]
        wheel = self._wheel(package)
        if wheel is None:
            return self.fallback.read(module)
        relpath = module_relpath(module)
        where = f"{relpath} in {wheel.path.name}"
        try:
            with zipfile.ZipFile(wheel.path) as archive:
                if archive.getinfo(relpath).file_size > MAX_UPSTREAM_BYTES:
                    raise PatchgenError(
                        f"{where}: larger than {MAX_UPSTREAM_BYTES} bytes; not a modeling file patchgen reads"
                    )
                data = archive.read(relpath)
        except KeyError as exc:
            raise PatchgenError(
                f"upstream module {module!r} not found in {wheel.pin} (no {relpath} in "
                f"{wheel.path.name}); check the spec's 'module' key"
            ) from exc
        except (OSError, zipfile.BadZipFile) as exc:
            raise PatchgenError(f"{wheel.path}: cannot read {relpath}: {exc}") from exc
        return UpstreamFile(package, wheel.version, module, relpath, decode_source(data, where))


def decode_source(data: bytes, where: str) -> str:
    """UTF-8 with universal newlines, as `Path.read_text` decodes: the same release read from an installed package
    or from its wheel gives the same text."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PatchgenError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    return text.replace("\r\n", "\n").replace("\r", "\n")
