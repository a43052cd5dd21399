"""Project configuration from `[tool.patchgen]` in pyproject.toml."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from patchgen.errors import PatchgenError


@dataclass(frozen=True)
class ProjectConfig:
    root: Path
    specs_dir: Path
    templates_dir: Path
    generated_dir: Path
    pins: dict[str, str]
    # "package==version" (normalized name) -> the sha256 digests a wheel of that release may have
    wheel_sha256: dict[str, frozenset[str]] = field(default_factory=dict)

    def spec_path(self, model: str) -> Path:
        return self.specs_dir / f"{model}.toml"

    def models(self) -> list[str]:
        return sorted(p.stem for p in self.specs_dir.glob("*.toml"))


def find_root(start: Path | None = None) -> Path:
    """The nearest directory at or above `start` whose pyproject.toml has a [tool.patchgen] table."""
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        pyproject = candidate / "pyproject.toml"
        if pyproject.is_file() and b"[tool.patchgen]" in pyproject.read_bytes():
            return candidate
    raise PatchgenError(f"no pyproject.toml with a [tool.patchgen] table at or above {here}; run inside a project")


def load_config(root: Path | None = None) -> ProjectConfig:
    root = find_root(root)
    pyproject = root / "pyproject.toml"
    try:
        table = tomllib.loads(pyproject.read_bytes().decode("utf-8"))["tool"]["patchgen"]
    except UnicodeDecodeError as exc:
        raise PatchgenError(f"{pyproject}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except (tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        raise PatchgenError(f"{pyproject}: cannot read [tool.patchgen]: {exc}") from exc
    pins = table.get("pins", {})
    if not isinstance(pins, dict) or not all(isinstance(v, str) for v in pins.values()):
        raise PatchgenError(
            f"{pyproject}: [tool.patchgen] pins must map package names to exact versions, e.g. "
            f'pins = {{ transformers = "5.14.1" }}'
        )
    dirs = {key: _directory(table, key, root, pyproject) for key in ("specs", "templates", "generated")}
    generated = dirs["generated"].resolve()
    if generated == root.resolve() or not generated.is_relative_to(root.resolve()):
        raise PatchgenError(
            f"{pyproject}: [tool.patchgen] generated = {table['generated']!r}: must be a directory inside the "
            f'project, below its root (e.g. generated = "generated"); patchgen writes only there'
        )
    return ProjectConfig(
        root=root,
        specs_dir=dirs["specs"],
        templates_dir=dirs["templates"],
        generated_dir=dirs["generated"],
        pins=dict(pins),
        wheel_sha256=_wheel_hashes(table.get("wheel_sha256", {}), pyproject),
    )


_RELEASE = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!_-]*)")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _wheel_hashes(table: object, pyproject: Path) -> dict[str, frozenset[str]]:
    """`[tool.patchgen.wheel_sha256]`: `"transformers==5.14.1" = "<sha256>"` (or a list of digests)."""
    where = f"{pyproject}: [tool.patchgen.wheel_sha256]"
    if not isinstance(table, dict):
        raise PatchgenError(f'{where}: must be a table of "package==version" = "<sha256 of the wheel>"')
    hashes = {}
    for release, value in table.items():
        match = _RELEASE.fullmatch(release)
        if match is None:
            raise PatchgenError(f"{where}: keys are exact releases 'package==version', found {release!r}")
        digests = value if isinstance(value, list) else [value]
        if not digests or not all(isinstance(d, str) and _SHA256.fullmatch(d) for d in digests):
            raise PatchgenError(
                f"{where}: values are sha256 hex digests (64 lowercase hex characters, or a list of them), "
                f"found {release!r} = {value!r}"
            )
        name = re.sub(r"[-_.]+", "_", match.group(1)).lower()
        hashes[f"{name}=={match.group(2)}"] = frozenset(digests)
    return hashes


def _directory(table: dict, key: str, root: Path, pyproject: Path) -> Path:
    value = table.get(key, key)
    if not isinstance(value, str) or not value.strip():
        raise PatchgenError(
            f"{pyproject}: [tool.patchgen] {key} must be a directory path relative to the project root, "
            f"found {value!r}"
        )
    return root / value


def with_pins(text: str, pins: dict[str, str]) -> str:
    """pyproject.toml text with `[tool.patchgen] pins` (and exact `"pkg==old"` requirements) moved to `pins`.

    Edits the text in place, so comments and layout survive; the result is re-parsed to prove it says exactly that.
    """
    old = tomllib.loads(text)
    current = old["tool"]["patchgen"]["pins"]
    section = re.search(r"^\[tool\.patchgen\][^\n]*\n(?:(?!\[).*\n?)*", text, re.M)
    line = section and re.search(r"^pins\s*=\s*\{.*\}[^\n]*$", section.group(0), re.M)
    if not line:
        raise PatchgenError("pyproject.toml: cannot find a one-line `pins = { ... }` in [tool.patchgen] to update")
    new_line = line.group(0)
    for package, version in pins.items():
        new_line, count = re.subn(rf'(\b{re.escape(package)}\s*=\s*")[^"]*(")', rf"\g<1>{version}\g<2>", new_line)
        if count != 1:
            raise PatchgenError(f"pyproject.toml: [tool.patchgen] pins has no entry for {package!r}")
    start = section.start() + line.start()
    text = text[:start] + new_line + text[start + len(line.group(0)) :]
    for package, version in pins.items():  # exact requirements elsewhere (the runtime extra's), not wheel_sha256 keys
        text = re.sub(
            rf'"{re.escape(package)}=={re.escape(current[package])}"(?!\s*=)', f'"{package}=={version}"', text
        )
    if tomllib.loads(text)["tool"]["patchgen"]["pins"] != {**current, **pins}:
        raise PatchgenError("pyproject.toml: updating [tool.patchgen] pins did not give the expected pins")
    return text
