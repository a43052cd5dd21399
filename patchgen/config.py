"""Project configuration from `[tool.patchgen]` in pyproject.toml."""

from __future__ import annotations

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
        raise PatchgenError(f'{pyproject}: [tool.patchgen] pins must map package names to exact versions, e.g. '
                            f'pins = {{ transformers = "5.14.1" }}')
    return ProjectConfig(
        root=root,
        specs_dir=root / table.get("specs", "specs"),
        templates_dir=root / table.get("templates", "templates"),
        generated_dir=root / table.get("generated", "generated"),
        pins=dict(pins),
    )
