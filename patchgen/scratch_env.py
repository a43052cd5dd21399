"""The scratch venv of `patchgen upgrade --verify`: a release's wheels and their unmet requirements, layered over the
project venv, installing nothing whose sha256 the project does not record.

The wheel cache (`.patchgen-cache/wheels/`) is a folder anyone who can write into the project can fill, and a wheel
is code (a `.pth` file in it runs at every interpreter start; its modules run when the tests import them). So what
the scratch venv installs is only ever a wheel whose sha256 `[tool.patchgen.wheel_sha256]` records for its release:
the release's own wheels (already verified by `patchgen.wheels`) and, for each requirement the project venv does not
meet, the highest recorded release that meets it (from the cache, or downloaded; `wheels.obtain` refuses any other
file). Each is copied into the scratch directory, verified again there, and pip installs that copy alone
(`--no-index --no-deps`): it never searches a folder or an index. A requirement no recorded release meets, or whose
wheel is not the recorded file, is not installed: it is reported unmet with what to record.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import site
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from patchgen.errors import PatchgenError
from patchgen.upstream import Wheel, normalize_name, read_wheel
from patchgen.wheels import Target, obtain, pip_reason
from patchgen.wheels import verify as verify_wheel

MAX_ROUNDS = 8  # an installed requirement may need another one; a release's dependency chain is short


def project_site_packages() -> list[str]:
    """The running interpreter's (the project venv's) site-packages directories."""
    return list(dict.fromkeys(p for p in (*site.getsitepackages(), sysconfig.get_path("purelib")) if Path(p).is_dir()))


def unmet_requirements(site_dirs: list[Path | str], owners: list[str] | None = None) -> list[str]:
    """Requirements (no extras) of the distributions `owners` (default: every one in `site_dirs[0]`) that the
    distributions found along `site_dirs` (first one wins, as on sys.path) do not meet."""
    paths = [str(p) for p in site_dirs]
    found: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions(path=paths):
        found.setdefault(normalize_name(dist.metadata["Name"] or ""), dist)
    if owners is None:
        owners = [normalize_name(d.metadata["Name"] or "") for d in importlib.metadata.distributions(path=paths[:1])]
    unmet = []
    for owner in owners:
        for text in found[owner].requires or [] if owner in found else []:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            have = found.get(normalize_name(req.name))
            if have is None or not req.specifier.contains(have.version, prereleases=True):
                got = f"{have.version} installed" if have else "not installed"
                unmet.append(f"{req} (of {owner}; {got})")
    return unmet


def requirement_of(line: str) -> str:
    """The requirement of an `unmet_requirements` line."""
    return line.split(" (of ", 1)[0]


def recorded_release(requirement: str, trusted: dict[str, frozenset[str]]) -> str | None:
    """The highest release (`name==version`) with a recorded sha256 that meets `requirement`; None when none does."""
    req = Requirement(requirement)
    name, best = normalize_name(req.name), None
    for pin in trusted:
        package, _, text = pin.partition("==")
        try:
            version = Version(text)
        except InvalidVersion:
            continue
        if package == name and req.specifier.contains(version, prereleases=True) and (best is None or version > best):
            best = version
    return None if best is None else f"{name}=={best}"


def private_copy(wheel: Wheel, folder: Path, trusted: dict[str, frozenset[str]]) -> Path:
    """The wheel copied into `folder` (the scratch directory, the user's own) and verified there: what pip installs is
    the file whose hash was checked, whatever happens to the original afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / wheel.path.name
    shutil.copyfile(wheel.path, copy)
    copied = read_wheel(copy)
    if copied.pin != wheel.pin:
        raise PatchgenError(f"{wheel.path}: changed while it was copied (now {copied.pin}, was {wheel.pin})")
    verify_wheel(copied, trusted)
    return copy


def make_env(
    env: Path, wheels: list[Wheel], cache: Path, trusted: dict[str, frozenset[str]]
) -> tuple[Path, list[str], list[str]]:
    """A venv at `env` with the wheels (and those of their unmet requirements the project records a sha256 for) over
    the project venv; returns its python, what it installed, and the requirements still unmet (each with why)."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env)
    python = env / "bin" / "python"
    own = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    layered, copies = [own, *project_site_packages()], env.parent / "verified-wheels"
    pip_install(own, [private_copy(w, copies, trusted) for w in wheels])
    why: dict[str, str] = {}  # requirement -> why it was not installed
    for _ in range(MAX_ROUNDS):
        missing = [r for r in map(requirement_of, unmet_requirements(layered)) if r not in why]
        if not missing:
            break
        for requirement in missing:
            why[requirement] = _install_recorded(own, requirement, cache, trusted, copies)
    (own / "_patchgen_layer.pth").write_text("".join(f"{p}\n" for p in layered[1:]), encoding="utf-8")
    installed = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions(path=[str(own)]))
    unmet = [
        line + (f": {why[requirement_of(line)]}" if why.get(requirement_of(line)) else "")
        for line in unmet_requirements(layered)
    ]
    return python, installed, unmet


def _install_recorded(
    own: Path, requirement: str, cache: Path, trusted: dict[str, frozenset[str]], copies: Path
) -> str:
    """Install the recorded release meeting `requirement`; returns "" when installed, else why not (one line)."""
    pin = recorded_release(requirement, trusted)
    if pin is None:
        name = normalize_name(Requirement(requirement).name)
        return (
            f"not installed: no sha256 recorded for a {name} release that meets it; to install it, compare the hash "
            f'of such a release with the one the index publishes and add "{name}==<version>" = "<sha256>" to '
            f"[tool.patchgen.wheel_sha256] in pyproject.toml"
        )
    package, version = pin.split("==")
    try:
        wheel, _ = obtain(Target(pin, package, version), cache, trusted)
        pip_install(own, [private_copy(wheel, copies, trusted)])
    except PatchgenError as exc:
        return f"not installed: {exc}"
    return ""


def pip_install(target: Path, wheel_files: list[Path]) -> None:
    """Install exactly these wheel files into `target`: no index, no folder to search, no dependencies."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--only-binary=:all:", "--no-input"]
    command += ["--quiet", "--disable-pip-version-check", "--upgrade", "--target", str(target)]
    result = subprocess.run([*command, *map(str, wheel_files)], capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        names = ", ".join(p.name for p in wheel_files)
        raise PatchgenError(f"cannot install {names} into the scratch venv: {pip_reason(result)}")
