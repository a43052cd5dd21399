"""A drafted spec's text loaded as the engine loads ``specs/<name>.toml``, without writing it there: what the draft
pipeline proves by generating, and what a family member's draft is checked with (``family.py``)."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

from patchgen.config import ProjectConfig
from patchgen.spec import Spec, load_spec

__all__ = ["load_drafted"]


def load_drafted(config: ProjectConfig, name: str, text: str) -> Spec:
    """The drafted text loaded as the spec `specs/<name>.toml` would be, without writing it there."""
    with tempfile.TemporaryDirectory(prefix="patchgen-draft-") as folder:
        temp = Path(folder) / config.specs_dir.name / f"{name}.toml"  # a site a template quotes: specs/<name>.toml
        temp.parent.mkdir()
        for other in config.specs_dir.glob("*.toml"):  # what an `extends` draft inherits from sits beside it
            if other.name != temp.name:
                shutil.copy2(other, temp.parent / other.name)
        temp.write_text(text, encoding="utf-8")
        spec = load_spec(temp, config.templates_dir)
    return dataclasses.replace(spec, path=config.spec_path(name))
