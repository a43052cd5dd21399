"""Project configuration from `[tool.patchgen]` in pyproject.toml."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from patchgen.errors import PatchgenError


@dataclass(frozen=True)
class ProjectConfig:
    root: Path
    specs_dir: Path
    templates_dir: Path
    generated_dir: Path
    pins: dict[str, str]

    def spec_path(self, model: str) -> Path:
        return self.specs_dir / f"{model}.toml"

    def models(self) -> list[str]:
        return sorted(p.stem for p in self.specs_dir.glob("*.toml"))


def find_root(start: Path | None = None) -> Path:
    """The nearest directory at or above `start` whose pyproject.toml has a [tool.patchgen] table."""
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        pyproject = candidate / "pyproject.toml"
        if pyproject.is_file() and "[tool.patchgen]" in pyproject.read_text(encoding="utf-8"):
            return candidate
    raise PatchgenError(f"no pyproject.toml with a [tool.patchgen] table at or above {here}; run inside a project")


def load_config(root: Path | None = None) -> ProjectConfig:
    root = find_root(root)
    pyproject = root / "pyproject.toml"
    try:
        table = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["patchgen"]
    except (tomllib.TOMLDecodeError, KeyError) as exc:
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
    )


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
    for package, version in pins.items():  # exact requirements elsewhere, e.g. the runtime extra's
        text = text.replace(f'"{package}=={current[package]}"', f'"{package}=={version}"')
    if tomllib.loads(text)["tool"]["patchgen"]["pins"] != {**current, **pins}:
        raise PatchgenError("pyproject.toml: updating [tool.patchgen] pins did not give the expected pins")
    return text
