"""The review directory of `patchgen upgrade`: `upgrade-review/<release>/`, swapped in whole, never generated/.

Apart from the analysis (`patchgen.upgrade`) because it is the one place an upgrade writes when it does not apply:
the report, each new file built from the patches that apply, and its upstream diff.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from patchgen.config import ProjectConfig

if TYPE_CHECKING:
    from patchgen.upgrade import Upgrade

REVIEW_DIR = "upgrade-review"


def review_files(upgrade: Upgrade, report: str) -> dict[str, str]:
    """What the review directory holds: REPORT.md and each new generated file with its upstream diff."""
    files = {"REPORT.md": report}
    for model in upgrade.models:
        for one in model.generated.files if model.generated is not None else ():
            files[one.relpath] = one.text
            files[one.diff_relpath] = one.diff
    return files


def write_review(config: ProjectConfig, upgrade: Upgrade, report: str, extra: dict[str, str] | None = None) -> Path:
    """Replace `upgrade-review/<name>/` as a whole: a temp dir beside it is filled, then renamed into place.
    `extra`: more files by relative path (`specs.diff` of `--migrate`)."""
    final = config.root / REVIEW_DIR / upgrade.name
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{upgrade.name}."))
    try:
        for relpath, text in sorted({**review_files(upgrade, report), **(extra or {})}.items()):
            path = staging / relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8", newline="")
        if final.exists():
            old = final.with_name(f".{upgrade.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def with_specs(config: ProjectConfig, folder: Path) -> tuple[ProjectConfig, dict[Path, str]]:
    """`--with-specs DIR`: the run reads specs/ with each `DIR/<name>.toml` in place of `specs/<name>.toml` (a
    reviewed, committed migration such as docs/upgrades/transformers-5.23.0/specs/). The copy is a scratch folder of
    the review directory (the caller removes it: `shutil.rmtree(config.specs_dir)` of the returned config); specs/
    is never written. A file may change only what a migration changes (`patchgen.verify_edits`), so `--verify` runs
    no code a spec string added, and must replace a spec of specs/. Returns the run's config and the replaced texts
    by their specs/ path."""
    from patchgen.errors import PatchgenError
    from patchgen.verify_edits import check_spec_edits

    files = sorted(folder.glob("*.toml")) if folder.is_dir() else []
    if not files:
        raise PatchgenError(f"--with-specs {folder}: not a folder of spec files (*.toml)")
    unknown = [f.name for f in files if not (config.specs_dir / f.name).is_file()]
    if unknown:
        raise PatchgenError(f"--with-specs {folder}: {', '.join(unknown)} replace(s) no spec of {config.specs_dir}")
    texts = {config.specs_dir / f.name: f.read_text(encoding="utf-8") for f in files}
    try:
        check_spec_edits(config, {p.relative_to(config.root).as_posix(): t for p, t in texts.items()})
    except PatchgenError as exc:
        raise PatchgenError(f"--with-specs {folder}: {exc}") from exc
    (config.root / REVIEW_DIR).mkdir(exist_ok=True)  # in the project: generated headers name their spec's path
    scratch = Path(tempfile.mkdtemp(dir=config.root / REVIEW_DIR, prefix=".with-specs-"))
    for path in sorted(config.specs_dir.glob("*.toml")):
        (scratch / path.name).write_text(texts.get(path, path.read_text(encoding="utf-8")), encoding="utf-8")
    return dataclasses.replace(config, specs_dir=scratch), texts
