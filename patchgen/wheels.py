"""Release wheels for `patchgen upgrade --to` and `--from`: `package==version` or a local path -> a wheel on disk.

A requirement is looked up in a project-local cache (`.patchgen-cache/wheels/`, git-ignored) and, on a miss,
fetched with `python -m pip download --no-deps --only-binary=:all:` into it. Once there it is reused, so later
runs work offline. Nothing is installed or imported: the wheel is a zip that `upstream.WheelSource` reads.

A wheel is trusted by its content, never by its name: however it was obtained (a path, the cache, a download),
its sha256 must be one that `[tool.patchgen.wheel_sha256]` records for its release. A release with no recorded
hash is refused until the user records it (after comparing it with the hash the index publishes), and is never
downloaded before that.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from patchgen.errors import PatchgenError
from patchgen.provenance import file_sha256
from patchgen.upstream import Wheel, normalize_name, read_wheel

CACHE_DIR = ".patchgen-cache/wheels"
_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([0-9][A-Za-z0-9.+!_-]*)\s*")


@dataclass(frozen=True)
class Target:
    """What the user named: an exact release (`transformers==5.23.0`) or a wheel file."""

    text: str
    package: str | None = None  # normalized; None for a path until the wheel is read
    version: str | None = None
    path: Path | None = None


def parse_target(text: str) -> Target:
    if text.strip().endswith(".whl"):
        return Target(text, path=Path(text.strip()))
    match = _REQUIREMENT.fullmatch(text)
    if match is None:
        raise PatchgenError(
            f"{text!r}: expected an exact release `package==version` (e.g. transformers==5.23.0) "
            f"or the path of a .whl file"
        )
    return Target(text, normalize_name(match.group(1)), match.group(2))


def wheel_cache(root: Path) -> Path:
    return root / CACHE_DIR


def cached_wheel(cache: Path, package: str, version: str) -> Path | None:
    """A wheel for exactly `package==version` in the cache (by file name: `{name}-{version}[-build]-py-abi-plat`)."""
    for path in sorted(cache.glob("*.whl")) if cache.is_dir() else []:
        parts = path.name[: -len(".whl")].split("-")
        if len(parts) in (5, 6) and normalize_name(parts[0]) == package and parts[1] == version:
            return path
    return None


def download_wheel(package: str, version: str, cache: Path) -> Path:
    """`pip download` one wheel (no dependencies, no sdist) into `cache`; the file appears there complete or not at
    all (downloaded into a temp dir beside it, then renamed)."""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--no-input",
            "--disable-pip-version-check",
            "--quiet",
            f"{package}=={version}",
            "-d",
            tmp,
        ]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PatchgenError(f"cannot run pip to download {package}=={version}: {exc}") from exc
        if result.returncode != 0:
            raise PatchgenError(
                f"cannot download {package}=={version}: {pip_reason(result)}; offline? put the wheel into {cache} "
                f"or pass its path instead"
            )
        found = sorted(Path(tmp).glob("*.whl"))
        if len(found) != 1:
            raise PatchgenError(
                f"pip download {package}=={version} gave {[p.name for p in found]}; expected one wheel"
            )
        final = cache / found[0].name
        os.replace(found[0], final)
        return final


def pip_reason(result: subprocess.CompletedProcess) -> str:
    """pip's last error line (e.g. `No matching distribution found for x==1`): pip explains over many lines."""
    lines = [line.strip() for line in (result.stderr or result.stdout or "").splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    reason = (errors or lines or [f"pip exit {result.returncode}"])[-1]
    return reason if len(reason) <= 200 else reason[:197] + "..."


def obtain(target: Target, cache: Path, trusted: dict[str, frozenset[str]]) -> tuple[Wheel, bool]:
    """The wheel a target names, and whether it had to be downloaded; its sha256 must be recorded in `trusted`
    (`ProjectConfig.wheel_sha256`) for its release."""
    downloaded = False
    if target.path is not None:
        if not target.path.is_file():
            raise PatchgenError(f"{target.path}: no such wheel file")
        path = target.path
    else:
        path = cached_wheel(cache, target.package, target.version)
        if path is None:
            pin = f"{target.package}=={target.version}"
            if pin not in trusted:  # refused before anything is downloaded
                raise PatchgenError(
                    f"no sha256 recorded for {pin}, so it is not downloaded: patchgen reads only wheels whose hash "
                    f"the project records. Copy the wheel's sha256 from https://pypi.org/project/{target.package}/"
                    f'{target.version}/#files and add "{pin}" = "<sha256>" to [tool.patchgen.wheel_sha256] in '
                    f"pyproject.toml"
                )
            path, downloaded = download_wheel(target.package, target.version, cache), True
    wheel = read_wheel(path)
    if target.package is not None and (wheel.package, wheel.version) != (target.package, target.version):
        raise PatchgenError(f"{path}: the wheel is {wheel.pin}, expected {target.package}=={target.version}")
    verify(wheel, trusted, "the wheel cache" if path.parent == cache else None)
    return wheel, downloaded


def verify(wheel: Wheel, trusted: dict[str, frozenset[str]], found_in: str | None = None) -> None:
    """Refuse a wheel whose sha256 is not the one recorded for its release (or when none is recorded)."""
    actual = file_sha256(wheel.path)
    recorded = trusted.get(wheel.pin)
    if recorded is None:
        raise PatchgenError(
            f"{wheel.path}: no sha256 recorded for {wheel.pin} (this file's is {actual}); patchgen reads only "
            f"wheels whose hash the project records. Compare it with the hash the index publishes (e.g. "
            f"https://pypi.org/project/{wheel.package}/{wheel.version}/#files), then add "
            f'"{wheel.pin}" = "{actual}" to [tool.patchgen.wheel_sha256] in pyproject.toml'
        )
    if actual not in recorded:
        where = f"delete it from {found_in} and" if found_in else "obtain the genuine wheel, or"
        raise PatchgenError(
            f"{wheel.path}: sha256 {actual} is not the recorded sha256 of {wheel.pin} "
            f"({', '.join(sorted(recorded))} in [tool.patchgen.wheel_sha256]); this file is not that release: "
            f"{where} rerun to download it again"
        )


def obtain_all(
    texts: list[str], pins: dict[str, str], cache: Path, option: str, trusted: dict[str, frozenset[str]]
) -> list[tuple[Wheel, bool]]:
    """Wheels for `--to`/`--from` values: one per pinned upstream package, each verified against `trusted`."""
    pinned = {normalize_name(name): name for name in pins}
    out: list[tuple[Wheel, bool]] = []
    for text in texts:
        target = parse_target(text)
        if target.package is not None and target.package not in pinned:
            raise PatchgenError(
                f"{option} {text}: unknown package {target.package!r}; the pinned upstream packages "
                f"are {', '.join(sorted(pins)) or 'none'}"
            )
        wheel, downloaded = obtain(target, cache, trusted)
        if wheel.package not in pinned:
            raise PatchgenError(
                f"{option} {text}: the wheel is {wheel.pin}, not one of the pinned upstream "
                f"packages ({', '.join(sorted(pins)) or 'none'})"
            )
        if any(w.package == wheel.package for w, _ in out):
            raise PatchgenError(f"{option} names {wheel.package} twice")
        out.append((wheel, downloaded))
    return out
